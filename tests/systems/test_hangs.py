"""A hung rank is named: which rank, on which host, in which collective, and where it was (train/parallel/hang.py).

Two real hosts (network namespaces, tests/hosts.py), one gloo rank each, real launchers and torchrun agents;
rank 1 (on host n2) hangs after step 3, either stuck in Python (an endless loop in its dataset's
__getitem__, a task file of the test's own) or frozen outright (SIGSTOP). Every node's launcher must end
with one line that names it, exit 1."""
from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

from tests.conftest import PACED, TINY, clean_env, metrics
from tests.procs import wait_for, workers
from tests.systems.test_hosts import node, wait

SPIN_TASK = '''
import os

from train.tasks.image import ImageClassification


class SpinAfter:
    """The training set: on rank 1, after 24 samples (3 steps), an endless loop in __getitem__."""

    def __init__(self, inner):
        self.inner, self.reads = inner, 0

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, index):
        self.reads += 1
        while self.reads > 24 and os.environ.get("RANK") == "1":
            pass  # the hang
        return self.inner[index]


class Spin(ImageClassification):
    def datasets(self):
        train, ev = super().datasets()
        return SpinAfter(train), ev
'''


SPIN_LINE = next(n for n, line in enumerate(SPIN_TASK.splitlines(), 1) if "while" in line)


TIMEOUT_S = 5  # dist.timeout_s: how long the ranks that did join a collective wait for the others


TIMEOUT = [f"dist.timeout_s={TIMEOUT_S}", "train.steps=40"]


ARGS = ["--nnodes=2", "--nproc-per-node=1", "--rdzv-endpoint=n1:29400", "--stop-timeout=5"]


def start(make_hosts, tmp_path: Path, *overrides: str):
    a, b = make_hosts("n1", "n2")
    run = tmp_path / "run"
    over = [*TINY, *TIMEOUT, *overrides]
    pa = a.popen(node(run, *ARGS, "--rdzv-id=hang", overrides=over), clean_env(), tmp_path / "a.log")
    pb = b.popen(node(run, *ARGS, "--rdzv-id=hang", overrides=over), clean_env(), tmp_path / "b.log")
    def both():
        on = workers(pa.pid), workers(pb.pid)
        return on if all(on) else None

    # Ranks follow the nodes' addresses (torch's rendezvous sorts them): n1's is rank 0, n2's rank 1.
    on_a, on_b = wait_for(both, 120, "the workers on n1 and n2")
    assert list(on_a) == [0] and list(on_b) == [1], (on_a, on_b)
    ranks = on_a | on_b
    return run, (pa, tmp_path / "a.log"), (pb, tmp_path / "b.log"), ranks


def last_lines(*launches) -> list[tuple[int, str, str]]:
    out = []
    for proc, log in launches:
        rc, text = wait(proc, log, 120)
        out.append((rc, text.strip().splitlines()[-1], text))
    return out


def test_a_rank_stuck_in_python_is_named_with_its_host_collective_and_line(make_hosts, tmp_path):
    (tmp_path / "spin_task.py").write_text(SPIN_TASK)
    run, la, lb, _ = start(make_hosts, tmp_path, f"task.name={tmp_path / 'spin_task.py'}:Spin")
    for rc, last, text in last_lines(la, lb):
        assert rc == 1, text[-3000:]
        # e.g. error: rank 1 on n2 did not join broadcast #35 (rank 0 waited 5 s); rank 1 was in
        # spin_task.py:18 __getitem__ (while ...); every rank's stack: RUN/logs/rank*.stacks.txt
        m = re.fullmatch(rf"error: rank 1 on n2 did not join (\w+) #(\d+) \(rank 0 waited {TIMEOUT_S} s\); "
                         rf"rank 1 was in spin_task\.py:{SPIN_LINE} __getitem__ \(while self\.reads > 24 .*\); "
                         r"every rank's stack: (\S+)/rank\*\.stacks\.txt", last)
        assert m, text[-3000:]
        assert m[1] in ("broadcast", "all_reduce") and int(m[2]) > 3 and m[3] == str(run / "logs"), last
    # Both ranks' stacks, every thread: rank 1's shows the loop and how the trainer got there.
    stacks = (run / "logs" / "rank1.stacks.txt").read_text()
    assert f"spin_task.py\", line {SPIN_LINE} in __getitem__" in stacks and "in train_step" in stacks, stacks
    assert (run / "logs" / "rank0.stacks.txt").exists()
    assert max(m["step"] for m in metrics(run) if "loss" in m) == 3


def freeze_at_step_3(make_hosts, tmp_path: Path, rank: int):
    """Both nodes' launches, rank `rank` frozen (SIGSTOP) once step 3 is logged; the monotonic time it froze."""
    run, la, lb, ranks = start(make_hosts, tmp_path, *PACED)  # paced: frozen after step 3, long before step 40
    wait_for(lambda: (run / "metrics.jsonl").exists() and any(m.get("step") == 3 for m in metrics(run)), 120,
             "step 3")
    os.kill(ranks[rank], signal.SIGSTOP)
    return run, la, lb, time.monotonic()


# The most a frozen rank's job takes to end, from the freeze: the others' collective timeout (TIMEOUT_S), the
# report (at most 2 ANSWER_S + 5 s where the frozen rank holds the store), the frozen rank's node's launcher
# killing it (KILLED: else torchrun would SIGKILL it after its 30 s grace, or never where it is rank 0, the
# store's host), and the launchers' own ending under a loaded machine's delays. Measured: 11 s (rank 1 frozen)
# and 22 s (rank 0).
KILLED = re.compile(r"launch: rank (\d) \(pid \d+\) did not answer the hang report: killed, so that torchrun ends "
                    r"its group now")


ENDED_WITHIN_S = TIMEOUT_S + 40


def test_a_frozen_rank_is_named_as_not_answering(make_hosts, tmp_path):
    run, la, lb, stopped = freeze_at_step_3(make_hosts, tmp_path, 1)
    for (rc, last, text), killed in zip(last_lines(la, lb), ([], ["1"]), strict=True):
        assert rc == 1, text[-3000:]
        assert re.fullmatch(rf"error: rank 1 on n2 did not join (broadcast|all_reduce) #\d+ "
                            rf"\(rank 0 waited {TIMEOUT_S} s\); rank 1 did not answer \(stopped or frozen\); "
                            r"every rank's stack: \S+", last), text[-3000:]
        assert KILLED.findall(text) == killed, text[-3000:]  # by its own node's launcher, once
    took = time.monotonic() - stopped
    print(f"both launchers ended {took:.1f} s after the SIGSTOP")
    assert took < ENDED_WITHIN_S, took
    assert (run / "logs" / "rank0.stacks.txt").exists() and not (run / "logs" / "rank1.stacks.txt").exists()


def test_a_frozen_rank_0_which_holds_the_store_is_named_and_the_job_still_ends(make_hosts, tmp_path):
    """Rank 0's process serves the group's store (env://): frozen, it takes the store with it. A new connection
    to it would wait forever; rank 1's node still ends, within seconds of its timeout, naming rank 0 and its
    host; and so does rank 0's node, whose only worker is the frozen one: nothing fails there (its torchrun
    also hosts the rendezvous, so the other node's end reaches no one), and its launcher kills rank 0."""
    run, la, lb, stopped = freeze_at_step_3(make_hosts, tmp_path, 0)
    rc, text = wait(*lb, ENDED_WITHIN_S)
    assert rc == 1, text[-3000:]
    assert re.fullmatch(r"error: rank 0 on n1 did not answer \(stopped or frozen, or its host was lost: it holds "
                        rf"the process group's store\); rank 1 waited {TIMEOUT_S} s in (broadcast|all_reduce) #\d+",
                        text.strip().splitlines()[-1]), text[-3000:]
    line = text.strip().splitlines()[-1]
    print(f"n2's launcher ended {time.monotonic() - stopped:.1f} s after the SIGSTOP")
    rc, text = wait(*la, max(1.0, stopped + ENDED_WITHIN_S - time.monotonic()))
    assert rc == 1, f"n1's launcher did not end {ENDED_WITHIN_S} s after the SIGSTOP:\n{text[-3000:]}"
    assert text.strip().splitlines()[-1] == line and KILLED.findall(text) == ["0"], text[-3000:]
    print(f"n1's launcher ended {time.monotonic() - stopped:.1f} s after the SIGSTOP")
