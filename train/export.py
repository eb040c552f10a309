"""python -m train.export RUN_DIR [--step N] [--format pt|hf] [--merged] [--dtype D] [--max-shard-size S] [--out PATH]
                          [--force]

--format pt (the default): one plain file, the model's state dict (parameter and buffer names -> tensors)
written by torch.save, that any process loads with torch.load(FILE, weights_only=True), without this
package, e.g. into the task's model with load_state_dict. It reads the whole model into host memory (the
checkpoint's files by DCP, in this one process). Default: RUN_DIR/export/step_XXXXXXXX.pt.
--format hf: a Hugging Face model folder that transformers' AutoModelForCausalLM.from_pretrained loads, and so
vLLM, lm-eval-harness and the Hub; for tasks that say how (Task.hf_model: the built-in GPT as
GPT2LMHeadModel, the Hugging Face task as its own architecture). config.json, the safetensors files as
transformers' save_pretrained splits and names them (model.safetensors, or model-00001-of-0000N.safetensors
and model.safetensors.index.json beyond --max-shard-size, 5GB by default), and the files of the folder the run
started from (task.path, task.init_from: its tokenizer, its generation_config.json). The files' keys and
shapes are checked against the checkpoint and against the model transformers builds from that config.json
(on the meta device) before anything is written. One file at a time is read from the checkpoint (DCP, only
its tensors), cast, written and freed: the export holds one file's tensors, whatever the model's size.
Default: RUN_DIR/export/step_XXXXXXXX-hf/.
A run that trained LoRA adapters (the Hugging Face task's task.lora_rank): --format hf writes the adapters as peft's
save_pretrained writes them (adapter_model.safetensors, adapter_config.json, README.md), which
peft.PeftModel.from_pretrained loads over the model of task.path; with --merged, the model folder above, each
adapted weight with its adapters' product added (peft's merge), which transformers loads alone (default:
RUN_DIR/export/step_XXXXXXXX-hf-merged/).
--dtype: the floating tensors' type in the files (default: as trained, fp32); integer and bool tensors keep
theirs.

The checkpoint (the latest, or that of step N) is checked (its files' CRC-32s) and read in this one
process, whatever the number of ranks that saved it. A bad RUN_DIR, no checkpoint or no checkpoint of step N, a
damaged checkpoint (a truncated trainer.pt, a file that fails its checksum: the line names the earlier steps to
export instead), a task without a Hugging Face form, a checkpoint or a config.json that does not fit the model, an
--out below a file or in a folder this user cannot write: one line, exit 2, nothing written.

Nothing this command did not write is deleted or overwritten. An export leaves a marker (MARKER inside the
folder; .NAME.train-export.json beside a pt file) listing its files, so the same export is replaced again
later; an --out that exists otherwise (a file, a folder that is not empty, an export changed since) is
refused in one line, exit 2, unless --force. The run directory, a folder holding it, anything in its
checkpoints or existing in the run beside the exports, the paths its task started from (task.path,
task.init_from, its data: any path in the run's task config, and resume=PATH; a relative one from the directory
the run was launched in, which its run_info.json records, whatever directory the export runs in), and a folder
holding another run's checkpoints are refused even with --force (compared as real paths: through symlinks). The
export is written beside --out first and renamed into place: a failure leaves --out as it was. Every file it
writes has the umask's mode (0644 under umask 022), as a file open() makes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from train import config
from train.checkpoint.dcp_io import Reader, error_text, read_state
from train.checkpoint.storage import (
    NAME,
    OLD_NAME,
    TRAINER,
    complete_checkpoints,
    convert_hint,
    file_crcs,
    old_checkpoints,
    read_manifest,
    verify,
)
from train.config import OneLineParser, UsageError
from train.errors import ConfigError, missing_path
from train.failures import UNWRITABLE  # the errnos of a folder this user may not write

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MARKER = ".train-export.json"  # in an hf export's folder; beside a pt file: .NAME.train-export.json
WRITER = "python -m train.export"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = OneLineParser(prog="python -m train.export", description=(
        "Write a checkpoint's model (the latest, or --step N) as one plain torch.save file (--format pt) or a Hugging "
        "Face model folder that transformers' from_pretrained loads (--format hf), read on this one process "
        "whatever the number of ranks that saved it. It never deletes or overwrites what it did not write."))
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (or its checkpoints/ folder)")
    p.add_argument("--step", type=int, help="the checkpoint of this step (default: the latest)")
    p.add_argument("--format", choices=("pt", "hf"), default="pt",
                   help="pt: one torch.save file; hf: a Hugging Face model folder")
    p.add_argument("--merged", action="store_true",
                   help="--format hf of a run that trained LoRA adapters (task.lora_rank): the model with the adapters "
                        "merged into its weights, a folder transformers loads alone (default: the adapters as peft "
                        "saves them)")
    p.add_argument("--dtype", choices=sorted(DTYPES),
                   help="the floating tensors' type (default: as trained); integer and bool tensors keep theirs")
    p.add_argument("--max-shard-size", metavar="SIZE",
                   help="--format hf: the largest safetensors file, as transformers' save_pretrained takes it "
                        "(e.g. 5GB, the default, or 100MB: units of 1000); beyond it, files "
                        "model-00001-of-0000N.safetensors and model.safetensors.index.json. The export holds one "
                        "file's tensors at a time (--format pt holds the whole model)")
    p.add_argument("--out", metavar="PATH",
                   help="where to write (default: RUN_DIR/export/step_XXXXXXXX.pt, step_XXXXXXXX-hf/ for --format "
                        "hf, step_XXXXXXXX-hf-merged/ with --merged); an existing PATH is replaced only if it is an "
                        "export this command wrote (unchanged), an empty folder, or with --force; a failed export "
                        "leaves it as it was")
    p.add_argument("--force", action="store_true",
                   help="replace an existing --out that is not an export of this command (your file or folder, "
                        "deleted once the export is written); never the run directory, its checkpoints or "
                        "other files, a folder holding them, the folders the run started from, or a folder "
                        "holding another run's checkpoints")
    return p.parse_args(argv)


def find(run_dir: Path, step: int | None) -> Path:
    """The checkpoint folder to export."""
    if not run_dir.exists():
        raise UsageError(str(missing_path("the run directory", run_dir, "a run's run.dir")))
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


def hf_form(run_config: dict, path: Path):
    """The task's Hugging Face form of its model (Task.hf_model), from the config the checkpoint was trained
    with, and the model (on meta where the task builds it there); UsageError where the task has none."""
    try:
        cfg = config.from_dict(run_config)
        task = cfg.task_class(cfg.task, cfg.seed)
        model = task.model()
        hf = task.hf_model(model)
    except ConfigError as e:
        raise UsageError(f"checkpoint {path}: its task does not build here ({e})") from None
    if hf is None:
        raise UsageError(f"checkpoint {path}: task {cfg.task_name} has no Hugging Face form (its hf_model() returns "
                         f"None): export it with --format pt")
    return hf, model


def shard_size(given: str | None) -> int:
    """--max-shard-size in bytes, read as transformers' save_pretrained reads max_shard_size."""
    try:
        from huggingface_hub.serialization._base import parse_size_to_int
    except ImportError as e:
        raise UsageError(f"--format hf needs huggingface_hub and safetensors ({e}): pip install -r "
                         f"requirements-hf.txt") from None
    try:
        size = parse_size_to_int(given or "5GB")
    except ValueError:
        size = 0
    if size <= 0:
        raise UsageError(f"--max-shard-size {given}: give a size such as 5GB or 100MB (KB, MB, GB, TB: powers of "
                         f"1000, as transformers' max_shard_size)")
    return size


def hf_plan(path: Path, cfg: dict, dtype, max_shard_size: int, merged: bool = False):
    """The hf export of checkpoint `path`, planned and checked (pretrained.hf_export; a run's adapters:
    pretrained.adapter_export) from the checkpoint's metadata alone: UsageError where it does not fit, before
    anything is read or written."""
    from train.checkpoint.pretrained import adapter_export, hf_export

    hf, model = hf_form(cfg, path)
    if merged and hf.adapters is None:
        raise UsageError(f"--merged: checkpoint {path} is of a run that trained no adapters (task.lora_rank 0): "
                         f"--format hf alone writes its weights")
    try:
        verify(path)
    except ValueError as e:
        raise UsageError(f"checkpoint {path} {e}: {instead(path)}") from None
    try:
        metadata = Reader(path).read_metadata()
    except Exception as e:
        raise UsageError(f"checkpoint {path} does not load ({error_text(e)}): {instead(path)}") from None
    stored = {fqn.removeprefix("model."): (md.size, md.properties.dtype)
              for fqn, md in metadata.state_dict_metadata.items()
              if fqn.startswith("model.") and isinstance(md, TensorStorageMetadata)}
    try:
        if hf.adapters is not None and not merged:
            return adapter_export(hf, model, stored, dtype)
        return hf_export(hf, model, stored, dtype, max_shard_size, merged)
    except ValueError as e:
        raise UsageError(f"checkpoint {path} {e}: nothing written") from None


# ---------------------------------------------------------------- a damaged checkpoint

def _step(path: Path) -> int:
    return int(path.name[5:])


def damage(path: Path, name: str) -> str | None:
    """What is wrong with the file `name` of checkpoint `path`, by the size and CRC-32 its manifest recorded (that
    one file read), or None where it is as saved (or the manifest does not say)."""
    want = read_manifest(path).get("files", {}).get(name)
    if not isinstance(want, dict):
        return None
    got = file_crcs([path / name])[0]
    if isinstance(got, FileNotFoundError):
        return f"its {name} is missing"
    if isinstance(got, OSError):
        return f"its {name} cannot be read ({got.strerror or got})"
    if got["bytes"] != want.get("bytes"):
        cut = "truncated" if isinstance(want.get("bytes"), int) and got["bytes"] < want["bytes"] else "damaged"
        return f"its {name} is {cut}: {got['bytes']} bytes where the save wrote {want.get('bytes')}"
    if got["crc32"] != want.get("crc32"):
        return f"its {name} is damaged: its CRC-32 differs from the one the save recorded"
    return None


def instead(path: Path) -> str:
    """The fix for checkpoint `path` that does not load: the earlier checkpoints of the run (those whose trainer.pt
    is as saved), else a copy of it."""
    earlier = [p for p in complete_checkpoints(path.parent) if p.name < path.name and damage(p, TRAINER) is None]
    if not earlier:
        return f"the run holds no earlier checkpoint to export instead: restore {path.name} from a copy"
    steps = ", ".join(str(_step(p)) for p in reversed(earlier))
    return (f"export an earlier one with --step {_step(earlier[0])} (saved: step{'s' * (len(earlier) > 1)} {steps}), "
            f"or restore {path.name} from a copy")


def _short(e: BaseException) -> str:
    """error_text's first sentence, cut at a word (torch's texts run to paragraphs)."""
    text = error_text(e).split(". ", 1)[0].rstrip(".")
    return text if len(text) <= 200 else text[:200].rsplit(" ", 1)[0] + " ..."


def trainer_file(path: Path) -> dict:
    """The checkpoint's trainer.pt (small): the config it was trained with, its step; read before its tensors so
    that a refused --out costs no read of the model. One that does not load: UsageError naming what is wrong with
    it (truncated, changed: by the size and CRC-32 the save recorded) and the checkpoint to export instead."""
    try:
        return torch.load(path / TRAINER, map_location="cpu", weights_only=True)
    except Exception as e:
        if found := damage(path, TRAINER):
            raise UsageError(f"checkpoint {path} is damaged ({found}): {instead(path)}") from None
        raise UsageError(f"checkpoint {path} does not load (its {TRAINER}: {_short(e)}): {instead(path)}") from None


# ---------------------------------------------------------------- what --out may replace


def launch_dir(run: Path) -> Path | None:
    """The working directory the run was launched from, as its run_info.json records it ("cwd", rank 0's, written at
    each start): the folder the relative paths of its config (kept as typed) start at. None for a run recorded before
    this was (no "cwd"), or without a readable run_info.json."""
    try:
        cwd = json.loads((run / "run_info.json").read_text()).get("cwd")
    except (OSError, ValueError, AttributeError):
        return None
    return Path(cwd) if isinstance(cwd, str) and os.path.isabs(cwd) else None


def sources(cfg: dict, cwd: Path | None = None) -> list[tuple[str, Path]]:
    """The paths the run started from or read (key, real path): every string of its task config that names an
    existing file or folder (task.path, task.init_from, task.data, a glob's folder), and resume=PATH. A relative one
    starts at `cwd`, the run's launch directory (launch_dir), so that they are the run's paths whatever folder the
    export runs in; for a run recorded before the launch directory was (cwd None), at this process's working
    directory, as before (from another folder such a run's relative paths are not protected)."""
    found = []

    def visit(key: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                visit(f"{key}.{k}", v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(key, v)
        elif isinstance(value, str) and value.strip():
            parts = Path(value).parts
            glob = next((i for i, part in enumerate(parts) if any(c in part for c in "*?[")), len(parts))
            path = Path(*parts[:glob]) if glob else None
            if path is not None and cwd is not None:
                path = cwd / path  # an absolute path stays itself
            if path is not None and os.path.lexists(path):
                found.append((key, path.resolve()))

    visit("task", {k: v for k, v in (cfg.get("task") or {}).items() if k != "name"})
    if cfg.get("resume") not in (None, "auto", "never"):
        visit("resume", cfg["resume"])
    return found


def held_checkpoint(out: Path) -> Path | None:
    """A run's checkpoint at or below the folder `out` (a step_XXXXXXXX folder, or an earlier release's
    step_XXXXXXXX.pt; not through symlinks): in a run directory's checkpoints/, a checkpoints folder named itself, a
    folder holding runs. None where there is none."""
    if not out.is_dir() or out.is_symlink():
        return None
    for p in (out, *sorted(out.rglob("step_*"))):
        if p.is_symlink():
            continue
        if NAME.match(p.name) and p.is_dir() or OLD_NAME.match(p.name) and p.with_suffix(".json").is_file():
            return p
    return None


def _inside(path: Path, folder: Path) -> bool:
    return path != folder and path.is_relative_to(folder)


def _listing(folder: Path) -> dict[str, list]:
    """Each entry under `folder` but the marker: [kind, size, mtime_ns] (what an export's marker records)."""
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if rel != MARKER:
            st = p.lstat()
            kind = "dir" if p.is_dir() and not p.is_symlink() else "link" if p.is_symlink() else "file"
            out[rel] = [kind, st.st_size if kind == "file" else 0, st.st_mtime_ns if kind == "file" else 0]
    return out


def _marker_of(out: Path, fmt: str) -> Path:
    return out / MARKER if fmt == "hf" else out.with_name(f".{out.name}.train-export.json")


def _read_marker(marker: Path) -> dict | None:
    try:
        data = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("written_by") == WRITER else None


def is_own_export(out: Path, fmt: str) -> bool:
    """`out` is an export that this command wrote, as it wrote it: its marker lists exactly what is there."""
    marker = _read_marker(_marker_of(out, fmt))
    if marker is None or marker.get("format") != fmt:
        return False
    if fmt == "hf":
        return out.is_dir() and not out.is_symlink() and marker.get("files") == _listing(out)
    st = out.lstat()
    return out.is_file() and not out.is_symlink() and marker.get("files") == {out.name: ["file", st.st_size,
                                                                                          st.st_mtime_ns]}


def _unwritable(folder: Path, why: str = "") -> str:
    why = f" ({why})" if why else ""
    return (f"--out's parent {folder} is not writable by uid {os.getuid()} gid {os.getgid()}{why}: choose a writable "
            f"--out, or make {folder} writable by that user")


def check_folder(out: Path) -> None:
    """Where --out (a real path) would be written: the nearest of its parents that exists must be a folder this user
    may write in (the export is written beside --out and renamed into place; the parents not made yet are made
    there). UsageError (one line) naming the parent that is a file, or the folder that is not writable."""
    folder = next(p for p in out.parents if os.path.lexists(p))  # "/" at least
    if not folder.is_dir():
        kind = "a file, not a folder" if folder.is_file() else "not a folder"
        raise UsageError(f"--out's parent {folder} is {kind}: choose another --out")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(_unwritable(folder))


def check_out(given: Path, fmt: str, force: bool, run: Path, checkpoints: Path, cfg: dict, default: Path,
              cwd: Path | None = None) -> Path:
    """The real path to write the export at, or UsageError (one line) where that would delete or overwrite what
    this command did not write: the run's own files, the paths it started from (relative ones from `cwd`, its launch
    directory: sources) and another run's checkpoints never, a path of the user's only with --force."""
    out = given.resolve()
    never = f"export never writes there, even with --force; give another --out (default: {default})"
    protected = [(run, "the run directory"), (checkpoints, "the run's checkpoints"),
                 *((path, f"{key} of the run, a path it started from") for key, path in sources(cfg, cwd))]
    for path, what in protected:
        if out == path or _inside(path, out):
            relation = "is" if out == path else "holds"
            raise UsageError(f"--out {given} {relation} {what} ({path}): {never}")
    for path, what in protected[1:]:
        if _inside(out, path):
            raise UsageError(f"--out {given} is inside {what} ({path}): {never}")
    check_folder(out)
    if not os.path.lexists(out):
        if fmt == "pt" and os.path.lexists(marker := _marker_of(out, fmt)) and _read_marker(marker) is None \
                and not force:
            raise UsageError(f"{marker} exists and is not this command's: give another --out, or --force to "
                             f"replace it")
        return out
    if fmt == "pt" and out.is_dir():
        raise UsageError(f"--out {given} is a folder, and --format pt writes one file: give a file's path, e.g. "
                         f"{given / default.name}")
    if fmt == "hf" and not out.is_dir():
        raise UsageError(f"--out {given} is a file, and --format hf writes a folder: give another --out (default: "
                         f"{default})")
    if is_own_export(out, fmt) or (fmt == "hf" and not any(out.iterdir())):
        return out  # this command's export as it wrote it, or an empty folder: nothing of anyone else's is lost
    what = "is a file" if fmt == "pt" else f"is a folder of {sum(1 for _ in out.rglob('*'))} entries"
    if (held := held_checkpoint(out)) is not None:
        relation = "is" if held == out else "holds"
        raise UsageError(f"--out {given} {relation} a checkpoint of another run ({held}): {never}")
    if _inside(out, run):
        raise UsageError(f"--out {given} {what} in the run directory {run} that is no export of this command as it "
                         f"wrote it: {never}")
    if not force:
        raise UsageError(f"--out {given} {what} that is no export of this command as it wrote it (none, or changed "
                         f"since): give another --out, or --force to replace it")
    return out


# ---------------------------------------------------------------- writing it

class ExportFailed(Exception):
    """Writing the export failed (a full disk, a file of the source that does not read): --out is as it was."""


def umask_mode() -> int:
    """The mode a file made by open() gets here: 0o666 less the process's umask."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def give_umask_mode(tmp: Path) -> None:
    """Every file of the export at `tmp` (the file, or the folder's files) gets the umask's mode: safetensors'
    save_file makes its files 0600 whatever the umask (another account could not load the model), and a copy
    (shutil.copy2) keeps its source's mode."""
    mode = umask_mode()
    for p in (tmp, *(tmp.rglob("*") if tmp.is_dir() else ())):
        if p.is_file() and not p.is_symlink():
            os.chmod(p, mode)


def publish(out: Path, fmt: str, write, about: dict) -> None:
    """write(tmp) writes the export at `tmp`, beside `out` (the same file system); with its marker it is then
    renamed into place, what was at `out` moved aside and removed only after. Any failure removes what it wrote
    (and the folders it made) and leaves `out` as it was."""
    made = [p for p in (out.parent, *out.parent.parents) if not p.exists()]
    tmp = out.with_name(f".{out.name}.export-tmp{os.getpid()}")
    marker = _marker_of(tmp, fmt)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        give_umask_mode(tmp)
        if fmt == "hf":
            marker.write_text(json.dumps(about | {"files": _listing(tmp)}, indent=2) + "\n")
            if os.path.lexists(out):
                old = out.with_name(f".{out.name}.export-old{os.getpid()}")
                os.rename(out, old)
                try:
                    os.rename(tmp, out)
                except BaseException:
                    os.rename(old, out)
                    raise
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, out)
        else:
            st = tmp.stat()
            marker.write_text(json.dumps(about | {"files": {out.name: ["file", st.st_size, st.st_mtime_ns]}},
                                         indent=2) + "\n")
            os.replace(tmp, out)  # a crash between the two: the old marker does not fit the file, which is refused
            os.replace(marker, _marker_of(out, fmt))
    except BaseException as e:
        # The cleanup never raises over the error itself (a tmp path below a file is no folder: NotADirectoryError)
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        for leftover in (tmp, marker):
            try:
                leftover.unlink(missing_ok=True)
            except OSError:
                pass
        for folder in made:
            try:
                folder.rmdir()
            except OSError:
                break
        if isinstance(e, Exception):
            raise ExportFailed(error_text(e)) from e
        raise


def destination_error(out: Path, cause: BaseException | None) -> str | None:
    """A failed export's usage error, where its cause is --out's folder (one changed since check_folder, or one
    that refused what the check allowed): its line; None where the failure was something else."""
    try:
        check_folder(out)
    except UsageError as e:
        return str(e)
    if isinstance(cause, OSError) and cause.errno in UNWRITABLE and cause.filename is not None \
            and Path(cause.filename).parent == out.parent:  # creating a file or folder beside --out, or renaming one
        return _unwritable(out.parent, cause.strerror or "")
    return None


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 // 10 else f"{n / 2**10:.1f} KiB"


def save_pt(weights: dict, tmp: Path) -> None:
    with open(tmp, "wb") as f:
        torch.save(weights, f)
        f.flush()
        os.fsync(f.fileno())


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(argv)
        if args.max_shard_size is not None and args.format != "hf":
            raise UsageError("--max-shard-size splits --format hf's safetensors files; --format pt writes one file")
        if args.merged and args.format != "hf":
            raise UsageError("--merged writes a --format hf folder with a run's LoRA adapters merged into its "
                             "weights; --format pt writes the model's state dict as it trains (adapters apart)")
        path = find(Path(args.run_dir), args.step)
        checkpoints = path.parent
        run = checkpoints.parent if checkpoints.name == "checkpoints" else checkpoints
        default = run / "export" / (f"{path.name}-hf{'-merged' * args.merged}" if args.format == "hf"
                                    else f"{path.name}.pt")
        given = Path(args.out) if args.out else default
        state = trainer_file(path)
        cfg, step, dtype = state["config"], state["step"], DTYPES.get(args.dtype)
        # The run's relative paths start at its launch directory; a run recorded before it was (no "cwd" in its
        # run_info.json) keeps the former rule: they start at this process's working directory
        out = check_out(given, args.format, args.force, run.resolve(), checkpoints.resolve(), cfg, default,
                        launch_dir(run))
        if args.format == "hf":
            plan = hf_plan(path, cfg, dtype, shard_size(args.max_shard_size), args.merged)
        else:
            try:
                weights = read_state(path, keys=("model",))["model"]
            except ValueError as e:
                raise UsageError(f"checkpoint {path} {e}: {instead(path)}") from None
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    about = {"written_by": WRITER, "format": args.format, "run": str(run.resolve()), "checkpoint": str(path.resolve()),
             "step": step, "dtype": args.dtype or "as trained"}
    try:
        if args.format == "hf":
            from train.checkpoint.pretrained import AdapterExport, save_adapters, save_hf

            if isinstance(plan, AdapterExport):
                publish(out, "hf", lambda tmp: save_adapters(path, plan, tmp), about | {"adapters": True})
                base = (cfg.get("task") or {}).get("path", "")
                print(f"wrote {given}: {plan.adapters.about}, {_size(plan.total_size)} as peft saves them, "
                      f"of {path} (step {step}); load them with peft.PeftModel.from_pretrained(transformers."
                      f"AutoModelForCausalLM.from_pretrained({base!r}), {str(given)!r}), or export the merged model "
                      f"with --merged")
                return 0
            publish(out, "hf", lambda tmp: save_hf(path, plan, tmp), about | ({"merged": True} if args.merged else {}))
            files = f"{len(plan.files)} safetensors files" if len(plan.files) > 1 else "one safetensors file"
            merged = ", its LoRA adapters merged" if args.merged else ""
            print(f"wrote {given}: a Hugging Face {plan.config['architectures'][0]}, "
                  f"{plan.total_size / 2**20:.1f} MiB in {files}, the model of {path} (step {step}{merged}); load it "
                  f"with transformers.AutoModelForCausalLM.from_pretrained({str(given)!r})")
            return 0
        if dtype is not None:
            weights = {k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()}
        publish(out, "pt", lambda tmp: save_pt(weights, tmp), about)
    except ExportFailed as e:
        if (usage := destination_error(out, e.__cause__)) is not None:
            print(f"error: {usage}; {given} is as it was", file=sys.stderr)
            return 2
        print(f"error: the export to {given} failed ({e}); {given} is as it was", file=sys.stderr)
        return 1
    size = sum(t.numel() * t.element_size() for t in weights.values())
    print(f"wrote {given}: {len(weights)} tensors, {size / 2**20:.1f} MiB, the model of {path} (step {step}); "
          f"load it with torch.load({given.name!r}, weights_only=True)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
