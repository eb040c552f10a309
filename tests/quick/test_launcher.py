"""The launcher keeps torchrun's child-failed report back to the end."""
from __future__ import annotations

import io

import pytest

from train.launch.passthrough import Passthrough

CHILD_FAILED = """Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 386, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: {trailing}
============================================================
train FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 4321)
============================================================
""".format(trailing=" ")  # torchrun's line ends in a space


@pytest.mark.parametrize("usage", [False, True])
def test_torchrun_s_child_failed_report_is_kept_back_to_the_end_and_dropped_after_a_usage_error(usage):
    """The launcher decides at the end, once torchrun has ended and the markers are read: shown as it came (before
    what followed it) for a failure, dropped after a usage error, whose line says it all."""
    out = io.StringIO()
    passthrough = Passthrough(out)
    for line in ["before\n", *CHILD_FAILED.splitlines(keepends=True), "after\n"]:
        passthrough.feed(line)
    assert out.getvalue() == "before\n"
    passthrough.close(failed_workers=not usage)
    assert out.getvalue() == ("before\nafter\n" if usage else f"before\n{CHILD_FAILED}after\n"), out.getvalue()


def test_the_restart_loop_guard_counts_progress_through_states_in_host_memory(tmp_path):
    """Launches that each crash but leave a newer state in host memory (checkpoint.memory_every) make progress:
    only launches in a row that fail at the same step, in memory or on disk, end in 2."""
    import json

    from train.checkpoint.storage import memory_folder
    from train.errors import EXIT_USAGE
    from train.launch.verdict import History

    run, shm = tmp_path / "run", tmp_path / "shm"
    disk = run / "checkpoints" / "step_00000004"
    disk.mkdir(parents=True)
    (disk / "manifest.json").write_text(json.dumps({"step": 4}))
    folder = memory_folder(shm, run)
    folder.mkdir(parents=True)
    opts = {"max_failed_launches": "2", "nnodes": "1", "node_rank": None}

    def launch(newer: int | None) -> int:
        history = History(run, opts, folder)
        if newer is not None:  # the launch crashed after a copy of step `newer`
            (folder / f"share0.slot{newer % 2}.step_{newer:08d}.pt").touch()
        return history.end(1, failed=True)

    assert History(run, opts, folder).start == 4
    assert [launch(6), launch(8), launch(10)] == [1, 1, 1]  # each advanced, in memory only
    assert History(run, opts, folder).start == 10
    assert [launch(None), launch(None)] == [1, EXIT_USAGE]  # two in a row at step 10


def test_a_standby_serves_the_next_round_only_where_torchrun_s_round_variables_alone_differ():
    """train/launch/standby.py: a standby imported torch under one round's environment; it may take the next
    round's only if nothing else changed (a variable a module reads at import would be stale), and none is kept
    for a round after the last restart torchrun allows."""
    from train.launch.standby import lasting, restarts_left

    round_0 = {"PATH": "/bin", "OMP_NUM_THREADS": "1", "LOCAL_RANK": "1", "RANK": "1", "WORLD_SIZE": "2",
               "MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "2",
               "TORCHELASTIC_ERROR_FILE": "/tmp/attempt_0/1/error.json"}
    round_1 = round_0 | {"RANK": "3", "WORLD_SIZE": "4", "MASTER_PORT": "29611", "TORCHELASTIC_RESTART_COUNT": "1",
                         "TORCHELASTIC_ERROR_FILE": "/tmp/attempt_1/1/error.json"}
    assert lasting(round_0) == lasting(round_1) == {"PATH": "/bin", "OMP_NUM_THREADS": "1", "LOCAL_RANK": "1"}
    assert lasting(round_1 | {"OMP_NUM_THREADS": "4"}) != lasting(round_0)
    assert lasting(round_1 | {"LOCAL_RANK": "0"}) != lasting(round_0)
    assert restarts_left(round_0) and restarts_left(round_1)
    assert not restarts_left(round_1 | {"TORCHELASTIC_RESTART_COUNT": "2"})
    assert not restarts_left({"PATH": "/bin"})  # not under torchrun's agent


def test_a_standby_imports_what_the_last_round_s_worker_listed_and_stops_when_its_round_comes(tmp_path, monkeypatch):
    """train/startup.py: a worker lists its modules after its first step (note_imports); the standby imports those
    it lacks, in order (a task's model library: torchvision, transformers), skipping what it cannot, and stops as
    soon as its round comes (the worker imports the rest as it needs it)."""
    import sys
    import threading

    from train import startup

    listed = tmp_path / "imports-0"
    monkeypatch.setenv(startup.IMPORTS_VAR, str(listed))
    startup.note_imports()
    names = listed.read_text().split()
    assert "train.startup" in names and "sys" in names and not [n for n in names if n.startswith("__")]

    for name in ("colorsys", "wave"):
        sys.modules.pop(name, None)
    listed.write_text("colorsys\nno_such_module_here\n")
    startup._import_listed(str(listed), threading.Event())
    assert "colorsys" in sys.modules  # and the module that is not there was passed over

    assigned = threading.Event()
    assigned.set()
    listed.write_text("wave\n")
    startup._import_listed(str(listed), assigned)
    assert "wave" not in sys.modules


def test_a_standby_s_imports_go_on_at_the_worker_s_priority_once_its_round_comes():
    """train/startup.py: a standby's imports run on a thread at nice 19. Left at 19 once the round comes, the imports
    still under way would take minutes on cores the other ranks keep busy, and the round would wait for them: the
    thread's priority is raised back to the worker's, where the process may (CAP_SYS_NICE: root in a container).
    Where it may not, nothing changes and the standby starts afresh (tests/processes/test_launcher.py)."""
    import os
    import threading

    from train import startup

    lowered, round_came, seen = threading.Event(), threading.Event(), []

    def imports() -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        lowered.set()
        round_came.wait(30)
        seen.append(os.getpriority(os.PRIO_PROCESS, 0))  # this thread's (Linux)

    thread = threading.Thread(target=imports)
    thread.start()
    lowered.wait(30)
    may = startup.raise_to_this_thread(thread)
    round_came.set()
    thread.join()
    assert seen == [os.getpriority(os.PRIO_PROCESS, 0) if may else 19]
    assert may or os.geteuid() != 0  # CI and the image run the suite as root
