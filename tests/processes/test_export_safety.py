"""`python -m train.export` never deletes or overwrites what it did not write (issue 49): the run directory, a
folder holding it, its checkpoints and the folders the run started from are refused even with --force; a user's
file or folder only with --force; its own earlier export is replaced; a failure half-way leaves --out as it was.
Each case hashes the whole tree that must survive, before and after."""
from __future__ import annotations

import grp
import json
import os
import pwd
import random
import resource
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.conftest import PY, ROOT, clean_env, copy_run
from tests.quick.test_export_safety import tree
from train import export

hf_models = pytest.importorskip("tests.hf_models", reason="pip install -r requirements-hf.txt")


# configs/hf.yaml shrunk as in tests/test_hf_task.py, on one rank, to step 2 (a checkpoint there).
HF = ["--config", "configs/hf.yaml", "task.seq_len=32", "train.precision=fp32", "train.global_batch_size=4",
      "train.micro_batch_size=4", "train.steps=2", "train.log_every=1", "train.eval_every=0", "optim.warmup_steps=0",
      "checkpoint.every=2", "data.num_workers=0", "dist.strategy=ddp", "log.wandb.mode=disabled", "log.report=false"]


README = 1 << 20  # a model card in the model folder, bigger than the tiny model's safetensors: the export copies it


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory) -> tuple[Path, Path]:
    """(root, run): root holds model/ (a tiny Llama with its tokenizer and a 1 MiB README.md: task.path),
    shards/ (task.data) and run/, the Hugging Face task fine-tuned from model/ to step 2 on one process."""
    from train import prepare

    root = tmp_path_factory.mktemp("hf_run")
    folder = hf_models.tiny_llama(root / "model")
    (folder / "README.md").write_text("a tiny model\n" * (README // 13 + 1))
    text = root / "corpus.txt"
    text.write_text(" ".join(random.Random(0).choice(hf_models.TEXT.split()) for _ in range(3000)))
    assert prepare.main([str(text), str(root / "shards"), "--tokenizer", str(folder)]) == 0
    text.unlink()
    run = root / "run"
    proc = subprocess.run([PY, "-m", "train", *HF, f"task.path={folder}", f"task.data={root / 'shards'}",
                           f"run.dir={run}"], cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root, run


def refused(capsys, args: list[str], says: str) -> None:
    """export.main(args) is exit 2 and one line saying `says`."""
    assert export.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and says in err, err


def exported(capsys, args: list[str]) -> None:
    assert export.main(args) == 0, capsys.readouterr().err
    capsys.readouterr()


def test_the_run_its_parents_checkpoints_and_the_model_it_started_from_are_refused_even_with_force(capsys, hf_run):
    """--out on the run directory (as the issue did: exit 0, the run gone), a folder holding it, its checkpoints or a
    file in them, its config.yaml, the model folder it started from (task.path) or its tokenizer, its shards
    (task.data), a symlink to the run: exit 2 in one line, in either format, with or without --force, and every
    byte of the run, the model and the shards as it was."""
    root, run = hf_run
    link = root.parent / f"{root.name}-link"  # beside root: a symlink to the run, outside every protected folder
    link.symlink_to(run)
    step = run / "checkpoints" / "step_00000002"
    cases = [(run, "is the run directory"), (root, "holds the run directory"), (Path("/"), "holds the run directory"),
             (run / "checkpoints", "is the run's checkpoints"), (step, "is inside the run's checkpoints"),
             (step / "trainer.pt", "is inside the run's checkpoints"),
             (root / "model", "is task.path of the run, a path it started from"),
             (root / "model" / "tokenizer.json", "is inside task.path of the run"),
             (root / "model" / "new-export", "is inside task.path of the run"),
             (root / "shards", "is task.data of the run"), (link, "is the run directory")]
    before = tree(root)
    try:
        for out, says in cases:
            for fmt in ("pt", "hf"):
                for force in ([], ["--force"]):
                    refused(capsys, [str(run), "--format", fmt, "--out", str(out), *force], says)
        for fmt, out, says in [("pt", run / "config.yaml", "is a file in the run directory"),
                               ("hf", run / "export", None)]:
            if says is None:  # the run's export/ folder, once it holds an export: not one itself
                exported(capsys, [str(run), "--format", "pt"])
                before = tree(root)
                says = "is a folder of 2 entries in the run directory"
            for force in ([], ["--force"]):
                refused(capsys, [str(run), "--format", fmt, "--out", str(out), *force], says)
        assert tree(root) == before
        assert link.is_symlink() and link.resolve() == run
    finally:
        link.unlink()
    # The command itself: exit 2, one line, nothing else (the case: it said "wrote ..." with exit 0).
    proc = subprocess.run([PY, "-m", "train.export", str(run), "--format", "hf", "--out", str(run), "--force"],
                          cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert proc.stderr == (f"error: --out {run} is the run directory ({run}): export never writes there, even with "
                           f"--force; give another --out (default: {run}/export/step_00000002-hf)\n"), proc.stderr
    assert tree(root) == before


@pytest.mark.parametrize("fmt", ["pt", "hf"])
def test_a_path_of_yours_is_replaced_only_with_force_and_its_own_export_always(tmp_path, capsys, finished_run, hf_run,
                                                                                fmt):
    """A folder with a user's files (hf), an existing file (pt): exit 2 and every byte kept; --force replaces it.
    The command's own export (its marker lists its files) is replaced again without --force, unless something in it
    changed since; pt refuses a folder even with --force."""
    run = finished_run if fmt == "pt" else hf_run[1]
    out = tmp_path / ("weights.pt" if fmt == "pt" else "model-hf")
    if fmt == "pt":
        out.write_bytes(b"my own weights")
    else:
        (out / "notes").mkdir(parents=True)
        (out / "notes" / "todo.txt").write_text("mine")
        (out / "config.json").write_text("{}")
    args = [str(run), "--format", fmt, "--out", str(out)]
    before = tree(tmp_path)
    refused(capsys, args, f"--out {out} is a {'file' if fmt == 'pt' else 'folder of 3 entries'} that is no export "
                          f"of this command as it wrote it (none, or changed since): give another --out, or --force")
    assert tree(tmp_path) == before

    exported(capsys, [*args, "--force"])
    marker = out / ".train-export.json" if fmt == "hf" else tmp_path / ".weights.pt.train-export.json"
    about = json.loads(marker.read_text())
    assert about["step"] == (6 if fmt == "pt" else 2) and about["run"] == str(run.resolve()), about
    if fmt == "hf":
        assert not (out / "notes").exists() and (out / "README.md").stat().st_size >= README
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([out.name, *([marker.name] if fmt == "pt" else [])])

    exported(capsys, [*args, "--step", "4" if fmt == "pt" else "2"])  # its own export, again: no --force needed
    assert json.loads(marker.read_text())["step"] == (4 if fmt == "pt" else 2)
    if fmt == "pt":
        with open(out, "ab") as f:
            f.write(b"\0")  # changed since: a user's file now
        says = "is a file that is no export"
    else:
        (out / "mine.txt").write_text("added")  # a user's file in it now
        says = "is a folder of"
    before = tree(tmp_path)
    refused(capsys, args, says)
    assert tree(tmp_path) == before
    if fmt == "pt":
        folder = tmp_path / "folder"
        (folder / "a").mkdir(parents=True)
        before = tree(tmp_path)
        for force in ([], ["--force"]):
            refused(capsys, [str(run), "--out", str(folder), *force], f"--out {folder} is a folder, and --format pt "
                                                                       f"writes one file: give a file's path")
        assert tree(tmp_path) == before


def test_the_default_export_in_the_run_is_replaced_by_the_next_but_never_once_changed(tmp_path, capsys, finished_run):
    """RUN_DIR/export/step_N.pt again: replaced (the command's own). Changed by hand since: a file in the run that
    the command did not write, refused even with --force."""
    run = copy_run(finished_run, tmp_path / "run")
    default = run / "export" / "step_00000006.pt"
    exported(capsys, [str(run)])
    first = default.read_bytes()
    exported(capsys, [str(run / "checkpoints")])  # its checkpoints/ folder named: the same default, in the run
    assert default.read_bytes() == first
    assert sorted(p.name for p in (run / "export").iterdir()) == [".step_00000006.pt.train-export.json",
                                                                   "step_00000006.pt"]
    default.write_bytes(first[:-1] + b"x")
    before = tree(run)
    for force in ([], ["--force"]):
        refused(capsys, [str(run), *force], f"--out {default} is a file in the run directory {run} that is no export "
                                            f"of this command as it wrote it: export never writes there, even with "
                                            f"--force")
    assert tree(run) == before


def _exports_in_one_process(runs: list[list[str]], user: list[str] | None = None, preexec_fn=None
                            ) -> list[tuple[int, str]]:
    """Exports (each export.main's arguments) in one process of their own, under `user` (a command that changes
    it) if given, `preexec_fn` run in it before: each one's exit code and stderr, what the user sees of each."""
    script = ("import contextlib, io, json, sys\nfrom train import export\nfound = []\n"
              "for args in json.loads(sys.argv[1]):\n"
              "    err = io.StringIO()\n"
              "    with contextlib.redirect_stderr(err):\n"
              "        found.append((export.main(args), err.getvalue()))\n"
              "print(json.dumps(found))\n")
    proc = subprocess.run([*(user or []), PY, "-c", script, json.dumps(runs)], cwd=ROOT, env=clean_env(),
                          capture_output=True, text=True, timeout=300, preexec_fn=preexec_fn)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [tuple(r) for r in json.loads(proc.stdout.strip().splitlines()[-1])]


def _exports_on_a_full_disk(runs: list[list[str]], limit: int) -> list[tuple[int, str]]:
    """Exports in one process whose files may not grow beyond `limit` bytes (RLIMIT_FSIZE, SIGXFSZ ignored: a write
    past it fails with EFBIG, as on a full disk or quota): each one's exit code and stderr."""
    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    return _exports_in_one_process(runs, preexec_fn=limited)


@pytest.mark.parametrize("fmt", ["pt", "hf"])
def test_a_failure_half_way_leaves_out_as_it_was(tmp_path, capsys, finished_run, hf_run, fmt):
    """The export fails half-way (hf: after the safetensors and config.json, copying the model folder's 1 MiB
    README.md; pt: writing its one file), where --out is its own earlier export, a user's folder or file under
    --force, or nothing yet (in folders not made yet): exit 1 in one line, every byte of what was there kept, no
    temporary file or folder left, no folder made."""
    run = finished_run if fmt == "pt" else hf_run[1]
    limit = README // 2  # hf: above the tiny model's safetensors (~0.1 MiB); pt: below the small ResNet's 2.8 MiB
    own, yours, new = tmp_path / "own", tmp_path / "yours", tmp_path / "a" / "b" / "new"
    if fmt == "hf":
        exported(capsys, [str(run), "--format", fmt, "--out", str(own)])
        (yours / "sub").mkdir(parents=True)
        (yours / "sub" / "weights.safetensors").write_bytes(os.urandom(1000))
    else:
        exported(capsys, [str(run), "--step", "2", "--out", str(own)])
        yours.write_bytes(os.urandom(1000))
    before = tree(tmp_path)
    cases = [(own, []), (yours, ["--force"]), (new, [])]
    found = _exports_on_a_full_disk([[str(run), "--format", fmt, "--out", str(out), *force] for out, force in cases],
                                    limit)
    for (out, _), (rc, err) in zip(cases, found, strict=True):
        assert rc == 1 and err.count("\n") == 1 and err.startswith(f"error: the export to {out} failed (") \
            and err.endswith(f"); {out} is as it was\n"), (rc, err)
        assert fmt == "pt" or "OSError: [Errno 27] File too large" in err, err  # torch's zip writer: words of its own
    assert tree(tmp_path) == before
    exported(capsys, [str(run), "--format", fmt, "--out", str(new)])  # room enough: it works


def _export(*args: str, user: list[str] | None = None) -> subprocess.CompletedProcess:
    """python -m train.export ARGS, as the user sees it (under `user`, a command that changes it, if given)."""
    return subprocess.run([*(user or []), PY, "-m", "train.export", *args], cwd=ROOT, env=clean_env(),
                          capture_output=True, text=True, timeout=120)


def test_an_out_below_a_file_of_yours_is_one_line_and_the_file_is_kept(tmp_path, capsys, finished_run):
    """--out below a file (the issue's case: mkdir's FileExistsError, then a NotADirectoryError from the cleanup over
    it, a traceback and exit 1): exit 2 and one line naming the file and the fix, before the model is read; the file
    as it was and nothing beside it, in either format, also a level deeper."""
    afile = tmp_path / "afile"
    afile.write_text("hello\n")
    before = tree(tmp_path)
    says = f"error: --out's parent {afile.resolve()} is a file, not a folder: choose another --out\n"
    proc = _export(str(finished_run), "--out", str(afile / "x.pt"))
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", says), proc
    for fmt, out in (("pt", afile / "sub" / "x.pt"), ("hf", afile / "model-hf")):
        assert export.main([str(finished_run), "--format", fmt, "--out", str(out)]) == 2
        assert capsys.readouterr().err == says
    assert tree(tmp_path) == before


def test_an_out_in_a_folder_you_cannot_write_is_one_line_exit_2(finished_run):
    """A folder the user cannot write (as the issue: one line, but exit 1 and no fix named; a run.dir of the same
    kind is exit 2): exit 2 and one line naming the folder, the user and the fix, before the model is read; also the
    default --out in a run directory the user cannot write. Run as `nobody` (the tests run as root, whom no
    permission stops) in a world-readable copy of the run (pytest's folders are root's alone)."""
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: no user here whom a folder's permissions stop")
        user = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
        uid, gid = pwd.getpwnam("nobody").pw_uid, grp.getgrnam("nogroup").gr_gid
        probe = subprocess.run([*user, PY, "-c", "import train"], cwd=ROOT, env=clean_env(),
                               capture_output=True, text=True)
        if probe.returncode != 0:  # a checkout in a folder of root's alone (a CI clone in a mktemp folder)
            pytest.skip(f"nobody cannot run this checkout's Python: {probe.stderr.strip().splitlines()[-1:]}")
    else:
        user, uid, gid = [], os.getuid(), os.getgid()
    with tempfile.TemporaryDirectory(prefix="export-perm-") as folder:
        root = Path(folder).resolve()
        root.chmod(0o755)
        run = copy_run(finished_run, root / "run")
        ro = root / "read-only"
        ro.mkdir()
        (ro / "mine.txt").write_text("mine\n")
        for p in (ro, run):
            p.chmod(0o555)
        before = tree(root)
        cases = [(["--out", str(ro / "x.pt")], ro), (["--out", str(ro / "a" / "b" / "x.pt")], ro), ([], run)]
        found = _exports_in_one_process([[str(run), *args] for args, _ in cases], user=user)
        for (_, where), (rc, err) in zip(cases, found, strict=True):
            assert rc == 2, (rc, err)
            assert err == (f"error: --out's parent {where} is not writable by uid {uid} gid {gid}: choose a "
                           f"writable --out, or make {where} writable by that user\n"), err
        assert tree(root) == before
        run.chmod(0o755)  # for the TemporaryDirectory's cleanup (a non-root user's)
        ro.chmod(0o755)


# configs/gpt.yaml's tiny GPT on two shards of its own, to step 2 (a checkpoint there), a few CPU seconds.
GPT = ["--config", str(ROOT / "configs" / "gpt.yaml"), "task.seq_len=32", "train.global_batch_size=8",
       "train.micro_batch_size=4", "train.steps=2", "checkpoint.every=2", "train.eval_every=0", "train.log_every=1",
       "optim.warmup_steps=0", "data.num_workers=0", "log.wandb.mode=disabled", "log.report=false"]


@pytest.fixture(scope="module")
def relative_run(tmp_path_factory) -> Path:
    """The issue's project: proj/data/ (two shards) and proj/runs/rel/, a run launched in proj/ with task.data=data
    and run.dir=runs/rel, relative as typed. Returns proj/."""
    import numpy as np

    from train.tasks import shards

    proj = tmp_path_factory.mktemp("relative") / "proj"
    (proj / "data").mkdir(parents=True)
    tokens = (np.arange(4096, dtype=np.uint16) * 7) % 200
    shards.write_shard(proj / "data" / "chats_train_000000.bin", tokens, "llmc")
    shards.write_shard(proj / "data" / "chats_val_000000.bin", tokens[:2048], "llmc")
    proc = subprocess.run([PY, "-m", "train", *GPT, "task.data=data", "run.dir=runs/rel"], cwd=proj,
                          env=clean_env(PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proj


def test_the_paths_a_run_started_from_are_refused_from_any_directory(tmp_path, capsys, monkeypatch, relative_run):
    """The issue's case: a run launched in proj/ with task.data=data; from proj's parent, `export proj/runs/rel --out
    proj/data/chats_val_000000.bin --force` replaced the validation shard (exit 0: "data" was read from export's own
    directory). The run records where it was launched (run_info.json's "cwd"; its config keeps "data" as typed), and
    export reads the run's relative paths from there: exit 2 in one line, from proj's parent and from a folder that
    has a data/ of its own, every byte of proj/ as it was."""
    proj = relative_run
    run = proj / "runs" / "rel"
    assert json.loads((run / "run_info.json").read_text())["cwd"] == str(proj.resolve())
    assert "data: data\n" in (run / "config.yaml").read_text()
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "data").mkdir(parents=True)  # export's own data/ there: the old rule protected this one instead
    before = tree(proj)
    shard = proj / "data" / "chats_val_000000.bin"
    first = True  # the command as typed, in a process of its own; the other cases run export's main here
    for cwd, run_arg, out in [(proj.parent, "proj/runs/rel", "proj/data/chats_val_000000.bin"),
                              (elsewhere, str(run), str(shard)), (elsewhere, str(run), str(proj / "data"))]:
        for force in ([], ["--force"]):
            if first:
                proc = subprocess.run([PY, "-m", "train.export", run_arg, "--out", out, *force], cwd=cwd,
                                      env=clean_env(PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                                      timeout=120)
                code, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
                first = False
            else:
                monkeypatch.chdir(cwd)
                capsys.readouterr()
                code = export.main([run_arg, "--out", out, *force])
                stdout, stderr = capsys.readouterr()
            relation = "is" if out.endswith("data") else "is inside"
            assert (code, stdout) == (2, ""), (code, stdout, stderr)
            assert stderr == (f"error: --out {out} {relation} task.data of the run, a path it started from "
                              f"({(proj / 'data').resolve()}): export never writes there, even with --force; give "
                              f"another --out (default: {run_arg}/export/step_00000002.pt)\n"), stderr
    assert tree(proj) == before
    assert sorted(p.name for p in elsewhere.iterdir()) == ["data"]


def test_a_folder_holding_another_runs_checkpoints_is_refused_even_with_force(tmp_path, capsys, finished_run, hf_run):
    """--force onto another run (the issue: its checkpoints deleted, exit 0): its run directory, its checkpoints/,
    one checkpoint, a folder holding the run: exit 2 in one line naming the checkpoint, every byte kept."""
    other = copy_run(finished_run, tmp_path / "runs" / "other")
    checkpoint = other / "checkpoints" / "step_00000006"
    before = tree(tmp_path)
    run = hf_run[1]
    for out in (other, other / "checkpoints", checkpoint, tmp_path / "runs", tmp_path):
        for force in ([], ["--force"]):
            refused(capsys, [str(run), "--format", "hf", "--out", str(out), *force],
                    f"--out {out} {'is' if out == checkpoint else 'holds'} a checkpoint of another run ("
                    f"{other / 'checkpoints'}/step_0000000")
    assert tree(tmp_path) == before
    proc = _export(str(run), "--format", "hf", "--out", str(other), "--force")
    assert (proc.returncode, proc.stdout) == (2, ""), proc
    assert proc.stderr == (f"error: --out {other} holds a checkpoint of another run ({other / 'checkpoints'}/"
                           f"step_00000002): export never writes there, even with --force; give another --out "
                           f"(default: {run}/export/step_00000002-hf)\n"), proc.stderr
    assert tree(tmp_path) == before


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=["umask022", "umask027"])
def test_every_file_the_export_writes_has_the_umasks_mode(tmp_path, capsys, finished_run, hf_run, umask):
    """safetensors' save_file makes its files 0600 whatever the umask (the issue: another account could not load the
    model; config.json was 0644): every file of an hf export (the safetensors, config.json, the tokenizer and
    README.md copied from the model folder, the marker) and the pt file and its marker have 0666 less the umask."""
    old = os.umask(umask)
    try:
        exported(capsys, [str(hf_run[1]), "--format", "hf", "--out", str(tmp_path / "hf")])
        exported(capsys, [str(finished_run), "--out", str(tmp_path / "pt" / "model.pt")])
    finally:
        os.umask(old)
    modes = {p.relative_to(tmp_path).as_posix(): oct(p.stat().st_mode & 0o777)
             for p in tmp_path.rglob("*") if p.is_file()}
    assert {"hf/model.safetensors", "hf/config.json", "hf/README.md", "pt/model.pt"} <= modes.keys(), modes
    assert modes == dict.fromkeys(modes, oct(0o666 & ~umask)), modes
