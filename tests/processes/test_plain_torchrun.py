"""Plain torchrun (README: The entry point) after a stop: the ranks save a checkpoint, torchrun itself exits 1.

The README and docs/troubleshooting.md say so beside plain torchrun, and send schedulers to `python -m
train.launch`, whose same stop exits 75 (tests/processes/test_stops.py). A torch whose torchrun passes the
stop on as 75 fails here: then the pages change with it."""
from __future__ import annotations

import json
import signal
import subprocess

from tests.conftest import PACED, ROOT, clean_env, train_cmd
from tests.procs import finish, logged_steps, wait_for
from tests.quick.test_readme import README

TROUBLESHOOTING = (ROOT / "docs" / "troubleshooting.md").read_text()


def test_plain_torchrun_saves_on_a_sigterm_then_exits_1_not_75(tmp_path):
    proc = subprocess.Popen(train_cmd(tmp_path, *PACED, "train.steps=200", nproc=2), cwd=ROOT, env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    wait_for(lambda: proc.poll() is not None or any(s >= 3 for s in logged_steps(tmp_path)), 180, "step 3")
    proc.send_signal(signal.SIGTERM)
    rc, out, err = finish(proc)
    stopped = json.loads((tmp_path / "STOPPED").read_text())
    assert f"stopped on SIGTERM at step {stopped['step']}, checkpoint saved" in out + err, err[-3000:]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == f"step_{stopped['step']:08d}"
    # torch's own line, quoted by docs/troubleshooting.md, and its exit 1
    assert rc == 1, err[-3000:]
    last = [line for line in err.splitlines() if line.strip()][-1]
    assert last.startswith("torch.distributed.elastic.multiprocessing.api.SignalException: Process "), last
    assert last.endswith(" got signal: 15") and last.split(":")[0] in TROUBLESHOOTING
    assert "exits 1" in " ".join(README.split("## The entry point", 1)[1].split("##", 1)[0].split())
