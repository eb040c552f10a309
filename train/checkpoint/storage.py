"""A checkpoint's files on disk: atomic writes and renames, CRC-32s and the manifest, the check of a
checkpoint's files (verify), and which checkpoints of a folder are complete. No torch here: the launcher
reads which checkpoints are complete without DCP's import (half a second of CPU at each launch).
"""

from __future__ import annotations

import json
import mmap
import os
import re
import shutil
import threading
import time
import zlib
from pathlib import Path

FORMAT = 2
NAME = re.compile(r"^step_(\d{8})$")  # a checkpoint folder
OLD_NAME = re.compile(r"^step_(\d{8})\.pt$")  # format 1: one file (convert: python -m train.checkpoint --convert)
MANIFEST, TRAINER = "manifest.json", "trainer.pt"


# ---------------------------------------------------------------- files

class SaveError(RuntimeError):
    """A save that failed (a full disk, say): it never counts, and the checkpoints before it are intact."""


def fsync_dir(path: Path) -> None:
    """os.fsync of a folder (its entries) or a file (its bytes), by its path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def remove(path: Path, later: bool = False) -> threading.Thread | None:
    """Remove a checkpoint folder: renamed first (at once it no longer counts), then deleted; `later`: by a
    thread, returned, while training goes on (the save does not wait for the disk). A process killed
    before it is done leaves a .*.removed.tmp folder, which the next resume deletes."""
    gone = path.with_name(f".{path.name}.removed.tmp")
    os.replace(path, gone)
    if not later:
        shutil.rmtree(gone, ignore_errors=True)
        return None
    t = threading.Thread(target=shutil.rmtree, args=(gone,), kwargs={"ignore_errors": True}, daemon=True)
    t.start()
    return t


def file_crc(path: Path) -> dict:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return {"bytes": 0, "crc32": 0}
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return {"bytes": size, "crc32": zlib.crc32(m)}


def file_crcs(paths: list[Path]) -> list[dict | OSError]:
    """file_crc of each file, or the error reading it."""
    def one(path: Path) -> dict | OSError:
        try:
            return file_crc(path)
        except OSError as e:
            return e
    return [one(p) for p in paths]


def own_files(folder: Path, rank: int, known: dict[str, dict] | None = None) -> dict[str, dict]:
    """Size and CRC-32 of the files this rank wrote into a checkpoint folder (rank 0: also DCP's .metadata
    and trainer.pt): `known` (computed while writing), the others read back."""
    names = [p.name for p in folder.iterdir() if re.fullmatch(rf"__{rank}_\d+\.distcp", p.name)]
    if rank == 0:
        names += [".metadata", TRAINER]
    known = known or {}
    rest = sorted(n for n in names if n not in known)
    crcs = file_crcs([folder / n for n in rest])
    if errors := [e for e in crcs if isinstance(e, OSError)]:
        raise errors[0]
    found = {n: known[n] for n in names if n in known} | dict(zip(rest, crcs, strict=True))
    return dict(sorted(found.items()))


def publish(directory: Path, tmp: Path, step: int, files: dict, extra: dict) -> Path:
    """The last steps of a save (one process): the manifest of every rank's files, the folder renamed
    into place, `latest` moved to it."""
    manifest = {"format": FORMAT, "step": step, "time": time.time(), "files": files} | extra
    write_atomic(tmp / MANIFEST, lambda f: f.write(json.dumps(manifest).encode()))
    fsync_dir(tmp)
    path = directory / f"step_{step:08d}"
    if path.exists():  # the same step saved again (a stop right after a resume): the new one replaces it
        remove(path)
    os.replace(tmp, path)
    fsync_dir(directory)
    write_atomic(directory / "latest", lambda f: f.write(f"{path.name}\n".encode()))
    fsync_dir(directory)
    return path


def verify(path: Path, share: int = 0, shares: int = 1) -> dict:
    """A checkpoint folder's manifest, after checking the size and CRC-32 of its files (of every
    `shares`-th one from the `share`-th: the ranks split the reading); raises ValueError saying what is
    wrong with it."""
    if OLD_NAME.match(path.name) and path.is_file():
        raise ValueError(f"is in the format of an earlier version of this project: {convert_hint(path.parent)}")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = sorted(manifest["files"].items())
    except FileNotFoundError:
        raise ValueError(f"incomplete (no {MANIFEST}: a save cut short, or a copy without it)") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"unreadable ({MANIFEST}: {e})") from None
    mine = files[share::shares]
    for (name, want), got in zip(mine, file_crcs([path / name for name, _ in mine]), strict=True):
        if isinstance(got, OSError):
            raise ValueError(f"unreadable ({name}: {got.strerror})") from None
        if got["bytes"] != want.get("bytes"):
            raise ValueError(f"fails its checksum ({name}: {got['bytes']} bytes, expected {want.get('bytes')})")
        if got["crc32"] != want.get("crc32"):
            raise ValueError(f"fails its checksum ({name}: CRC-32 differs)")
    return manifest


def complete_checkpoints(directory: Path) -> list[Path]:
    """Checkpoint folders with their manifest, newest first, none newer than the one `latest` names."""
    if not directory.is_dir():
        return []
    found = sorted((p for p in directory.iterdir() if NAME.match(p.name) and (p / MANIFEST).exists()),
                   reverse=True)
    latest = directory / "latest"
    if latest.exists():
        name = latest.read_text().strip()
        if NAME.match(name):
            found = [p for p in found if p.name <= name]
    return found


def old_checkpoints(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    return sorted((p for p in directory.iterdir() if OLD_NAME.match(p.name) and p.with_suffix(".json").exists()),
                  reverse=True)


def convert_hint(folder: Path) -> str:
    return f"convert it with `python -m train.checkpoint --convert {folder}`, then resume"


def read_manifest(path: Path) -> dict:
    try:
        return json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}


def inside(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder.resolve())
        return True
    except ValueError:
        return False


# ---------------------------------------------------------------- host memory (checkpoint.memory_every)
# A node's states in host memory, in one folder per run under checkpoint.memory_dir (train/checkpoint/memory.py):
#     share<K>.slot<S>.bin                   the tensors of share K (a rank's, or a replica's), mapped from memory
#     share<K>.slot<S>.step_<NNNNNNNN>.pt    its record, written last: the share at that step is complete
# The step is in the record's name, so that the launcher sees progress without torch (launch/verdict.py).
MEMORY_RECORD = re.compile(r"^share(\d+)\.slot([01])\.step_(\d{8})\.pt$")
MEMORY_ID = "memory_id"  # <run_dir>/checkpoints/memory_id: which run a memory folder's states belong to


def memory_folder(memory_dir: Path, run_dir: Path) -> Path:
    """The folder of a run's states in host memory: one per user and run directory (its resolved path)."""
    import hashlib

    digest = hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
    return Path(memory_dir) / f"train-memory-{os.getuid()}-{digest}"


def memory_records(folder: Path) -> list[tuple[int, int, int, Path]]:
    """(step, share, slot, record) of the complete shares in a memory folder, newest first."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    found = [(int(m.group(3)), int(m.group(1)), int(m.group(2)), folder / n)
             for n in names if (m := MEMORY_RECORD.match(n))]
    return sorted(found, reverse=True)
