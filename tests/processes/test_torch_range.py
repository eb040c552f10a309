"""The torch versions the template runs on (train/supported.py): below the range every start is refused in one
line, above it a run goes on with one warning; across it the stop budget and asynchronous saves hold, whatever the
installed torchrun and DCP can do. `make test-torch TORCH=2.11.0` (and 2.15.0) runs this file with the tests that
cover the rest (Makefile: TORCH_TESTS)."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from importlib import metadata
from pathlib import Path

from torch.distributed.run import get_args_parser

from tests.conftest import PY, ROOT, TINY, clean_env, latest_state, run_train, summary
from tests.processes.test_stops import _stop_slowly
from train import supported

DRY_RUN = [PY, "-m", "train.launch", "--nproc-per-node=2", "--dry-run", "--", "--config", "configs/default.yaml"]


def _installed_as(tmp_path: Path, version: str) -> dict:
    """An environment in which pip's record of the installed torch says `version`, as on an image that holds that
    torch: a copy of its dist-info (torch's entry points with it) first on the path, its version changed. The
    torch that imports is this one."""
    real = metadata.distribution("torch")
    info = tmp_path / "site" / f"torch-{version}.dist-info"
    record = next(f for f in real.files if f.name == "METADATA" and f.parent.name.endswith(".dist-info"))
    shutil.copytree(Path(real.locate_file(record)).parent, info, ignore=shutil.ignore_patterns("RECORD"))
    text = (info / "METADATA").read_text()
    (info / "METADATA").write_text(re.sub(r"^Version: .*$", f"Version: {version}", text, count=1, flags=re.M))
    return clean_env(PYTHONPATH=str(tmp_path / "site"))


def test_a_torch_below_the_range_is_refused_in_one_line_by_every_entry_point(tmp_path):
    env = _installed_as(tmp_path, "2.10.0")
    for cmd in (DRY_RUN, [PY, "-m", "train", "--config", "configs/default.yaml", f"run.dir={tmp_path / 'run'}"]):
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith("error: torch 2.10.0 is older than this template supports (2.11 to 2.15): "
                                      f"install the pins (pip install {supported.PINS})"), proc.stderr
        assert "Keep the torch you have" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_a_torch_above_the_tested_range_runs_with_one_warning_line(tmp_path):
    env = _installed_as(tmp_path, "2.16.0")
    warning = "warning: torch 2.16.0 is newer than the versions this template is tested with (2.11 to 2.15)"
    proc = subprocess.run([PY, "-m", "train.launch", "--nproc-per-node=2", "--", "--config", "configs/default.yaml",
                           *TINY, "train.steps=2", f"run.dir={tmp_path / 'run'}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (proc.stdout + proc.stderr).count(warning) == 1, proc.stderr  # the launcher's, not every rank's too
    assert summary(tmp_path / "run")["steps"] == 2
    # without the launcher: rank 0's (here the only one)
    proc = run_train(tmp_path / "alone", "train.steps=1", env=env)
    assert proc.stderr.count(warning) == 1, proc.stderr


TORCHRUN_KNOWS_BUDGET = "--shutdown-timeout" in get_args_parser()._option_string_actions


# torchrun's own stop budget: where it takes --shutdown-timeout (2.14), 30 s unless PET_SHUTDOWN_TIMEOUT or
# TORCH_ELASTIC_SHUTDOWN_TIMEOUT says otherwise (set low here, so that a stop slower than it need not take 30 s to
# prove that the launcher's budget is the one torchrun applies); where it does not (2.11), a fixed 30 s.
TORCHRUN_OWN_S = 3 if TORCHRUN_KNOWS_BUDGET else 30


def test_a_stop_slower_than_torchruns_own_timeout_completes_within_the_launchers_budget(tmp_path):
    """The launcher's --stop-timeout is the budget torchrun applies: a save that ends after torchrun's own timeout
    is written. torch 2.11's torchrun has no --shutdown-timeout: the launcher's torchrun process gives its agent
    the budget instead (train/launch/torchrun.py)."""
    own = str(TORCHRUN_OWN_S)
    rc, out, err, took = _stop_slowly(tmp_path, ("--nproc-per-node=2", "--stop-timeout=60"),
                                      frozen_s=max(10, TORCHRUN_OWN_S + 5),
                                      env=clean_env(PET_SHUTDOWN_TIMEOUT=own, TORCH_ELASTIC_SHUTDOWN_TIMEOUT=own))
    signalled = time.time() - took  # when the SIGTERM was sent (at the latest)
    assert rc == 75, err[-3000:]
    stopped = json.loads((tmp_path / "STOPPED").read_text())  # written after the save completed
    assert stopped["step"] == latest_state(tmp_path)["step"] >= 2
    assert stopped["time"] - signalled > TORCHRUN_OWN_S + 5, stopped["time"] - signalled
