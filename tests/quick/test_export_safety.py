"""export's own errors: a failed write beside --out, a run directory that is not there."""
from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path

import pytest

from train import export


def tree(path: Path) -> dict[str, str]:
    """Every entry under `path` (itself included): a file's SHA-256, a folder, a link's target."""
    out = {}
    for p in [path, *sorted(path.rglob("*"))] if path.is_dir() else [path]:
        rel = str(p.relative_to(path)) if p != path else "."
        if p.is_symlink():
            out[rel] = f"-> {os.readlink(p)}"
        elif p.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.mark.parametrize("fmt", ["pt", "hf"])
def test_a_failed_write_beside_out_is_its_own_error_never_the_cleanups(tmp_path, fmt):
    """publish() itself, where the folder changed after the check: below a file (mkdir fails; its cleanup must not
    raise NotADirectoryError over that), or in a folder that refuses the write (EACCES). Each is ExportFailed, which
    main() tells as the usage error it is (exit 2, the fix: destination_error); nothing left, no folder made."""
    afile = tmp_path / "afile"
    afile.write_text("hello\n")
    before = tree(tmp_path)
    name = "x.pt" if fmt == "pt" else "model-hf"

    def refuse(tmp):
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp))

    for out, write, says in [
            (afile / name, lambda tmp: tmp.write_bytes(b"w"),
             f"--out's parent {afile} is a file, not a folder: choose another --out"),
            (tmp_path / "new" / name, refuse,
             f"--out's parent {tmp_path / 'new'} is not writable by uid {os.getuid()} gid {os.getgid()} (Permission "
             f"denied): choose a writable --out, or make {tmp_path / 'new'} writable by that user")]:
        with pytest.raises(export.ExportFailed) as failed:
            export.publish(out, fmt, write, {})
        assert export.destination_error(out, failed.value.__cause__) == says
        assert tree(tmp_path) == before
    with pytest.raises(export.ExportFailed) as failed:  # any other failure: not a usage error (exit 1, as before)
        export.publish(tmp_path / name, fmt, lambda tmp: 1 / 0, {})
    assert export.destination_error(tmp_path / name, failed.value.__cause__) is None


def test_a_run_directory_that_is_not_there_or_not_a_folder_is_named_as_such(tmp_path, capsys):
    """The first argument mistyped says that it does not exist (and where a relative path starts), a file says
    that it is a file: one line each, exit 2, nothing written."""
    afile = tmp_path / "afile"
    afile.write_text("hello\n")
    for arg, says in ((str(tmp_path / "nowhere"), f"{tmp_path / 'nowhere'} does not exist: check the path"),
                      ("no/such/run", f"no/such/run does not exist (relative paths start at {os.getcwd()})"),
                      (str(afile), f"{afile} is not a folder (give a run directory)")):
        assert export.main([arg]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and says in err and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_a_runs_relative_paths_start_where_it_was_launched_and_an_older_runs_where_export_runs(tmp_path,
                                                                                              monkeypatch):
    """run_info.json's "cwd" is where the run's relative paths start (launch_dir); a run recorded before it was
    there (no "cwd", no run_info.json) keeps the former rule: they start at export's own working directory."""
    run, launched, here = tmp_path / "run", tmp_path / "launched", tmp_path / "here"
    for folder in (run, launched / "data", here / "data", launched / "model"):
        folder.mkdir(parents=True)
    cfg = {"task": {"name": "x", "data": "data", "path": str(launched / "model"), "glob": "data/*.bin"},
           "resume": "model"}  # resume=PATH: launched/model, no model/ here
    monkeypatch.chdir(here)
    assert export.launch_dir(run) is None  # no run_info.json
    (run / "run_info.json").write_text(json.dumps({"command": ["train"]}))
    assert export.launch_dir(run) is None  # recorded before "cwd" was
    assert export.sources(cfg, export.launch_dir(run)) == [
        ("task.data", here / "data"), ("task.path", launched / "model"), ("task.glob", here / "data")]
    (run / "run_info.json").write_text(json.dumps({"command": ["train"], "cwd": str(launched)}))
    assert export.launch_dir(run) == launched
    assert export.sources(cfg, export.launch_dir(run)) == [
        ("task.data", launched / "data"), ("task.path", launched / "model"), ("task.glob", launched / "data"),
        ("resume", launched / "model")]
