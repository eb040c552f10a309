"""The one place a torchrun command line is built.

Every launcher (Makefile, sbatch, PyTorchJob, compose, the image's entrypoint) runs
    python -m train.launch [launcher options] [--] [training arguments]
Each launcher option falls back to an environment variable, its own name first and then the `PET_*`
one that torchrun and the Kubeflow operator use (e.g. --nnodes: NNODES, then PET_NNODES). With more
than one node and no rendezvous endpoint, MASTER_ADDR:MASTER_PORT (a PyTorchJob's Master replica)
hosts the c10d rendezvous.

The training arguments are checked before torchrun starts, so a bad config fails once, in one line.
One signal handler, installed first thing in main(), serves the launcher's whole life: stop signals
(TERM, INT, HUP, QUIT, USR1, USR2; HUP not where it was ignored at start, as under nohup) are passed to
torchrun once, as SIGTERM, which it passes on to the workers; they checkpoint and the launcher exits 75
("requeue me") if a checkpoint of this launch was written after the stop, or if the stop came before
training began (nothing was trained since the last checkpoint). The workers tell each node's launcher
how they ended in markers named by its launch's id (TRAIN_LAUNCH_ID; <run_dir>/.launch/), never by clocks,
and judged by torchrun's round that ended (_verdict). A rendezvous host still down at the join timeout is 75
(nothing trained); --max-failed-launches launches in a row that fail at one checkpoint step end in 2 (History).
The stop budget (--stop-timeout, STOP_TIMEOUT) is how long torchrun lets
the workers finish their step and save before it SIGKILLs them; the launcher also waits that long for
them when torchrun itself ends early (a second SIGTERM, as SLURM sends, cuts torchrun's own wait).
When torchrun fails, the launcher ends with one line saying why and what to try.
REQUEUE_EXIT_CODE replaces the launcher's 75 by another code, for a scheduler that retries only some codes
(a PyTorchJob's restartPolicy: ExitCode restarts 128-255 and fails the job on 1-127: k8s/pytorchjob.yaml).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import ipaddress
import json
import multiprocessing
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

from train import config
from train.errors import EXIT_REQUEUE, EXIT_USAGE, LAUNCH_ID_VAR, ConfigError

# The launcher's own code for "stopped after a checkpoint, relaunch me" where a scheduler needs another one
# (3-255): the PyTorchJob's restartPolicy ExitCode retries only 128-255 (k8s/pytorchjob.yaml sets 143).
REQUEUE_CODE_VAR = "REQUEUE_EXIT_CODE"
# A scheduler's grace period (SIGTERM to SIGKILL) is the stop budget plus this: torchrun's and the launcher's
# own exit after the workers' save (the launcher waits up to the budget + 5 s for them). The k8s manifests'
# terminationGracePeriodSeconds are STOP_TIMEOUT + GRACE_MARGIN_S (tests/test_k8s.py).
GRACE_MARGIN_S = 20
# Every signal a terminal, a scheduler or torchrun may send as a stop. torchrun passes TERM, INT, HUP and QUIT
# on to the workers unchanged (TORCHELASTIC_SIGNALS_TO_HANDLE), so the workers treat each as a stop too.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)

# option -> (its environment variables, default)
OPTIONS = {
    "nnodes": (("NNODES", "PET_NNODES"), "1"),
    "nproc_per_node": (("NPROC_PER_NODE", "PET_NPROC_PER_NODE"), "auto"),
    "node_rank": (("NODE_RANK", "PET_NODE_RANK"), None),
    "rdzv_endpoint": (("RDZV_ENDPOINT", "PET_RDZV_ENDPOINT"), None),
    "rdzv_id": (("RDZV_ID", "PET_RDZV_ID"), "train"),
    "rdzv_conf": (("RDZV_CONF", "PET_RDZV_CONF"), ""),
    "max_restarts": (("MAX_RESTARTS", "PET_MAX_RESTARTS"), "0"),
    # torchrun's --shutdown-timeout: it reads PET_SHUTDOWN_TIMEOUT and TORCH_ELASTIC_SHUTDOWN_TIMEOUT too
    "stop_timeout": (("STOP_TIMEOUT", "PET_SHUTDOWN_TIMEOUT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"), "30"),
    # launches in a row that fail without advancing the checkpoint step, after which the launcher exits 2
    "max_failed_launches": (("MAX_FAILED_LAUNCHES",), "3"),
}

# The last line of a torchrun traceback that the launcher's one line explains: the traceback is not shown.
QUIET_TRACEBACK = re.compile(r"^(torch\.distributed\.\S*)?(RendezvousConnectionError|RendezvousTimeoutError|"
                             r"RendezvousClosedError|DistNetworkError|DistStoreError)\b")

# What torchrun's output says, and what to tell the user (first match wins).
HINTS = [
    (re.compile(r"(?s)\A(?=.*RendezvousConnectionError)"  # the store answered once, then the connection broke
                r"(?=.*(Failed to recv|Connection was likely closed|Connection reset by peer|Broken pipe))"),
     "the rendezvous host {endpoint} was lost (its c10d store stopped answering): the other nodes cannot go on "
     "without it; restart the job on every node with the same --rdzv-id (a scheduler's restart does): it resumes "
     "from the latest checkpoint"),
    (re.compile(r"EADDRINUSE|Address already in use"),
     "the rendezvous port {port} is already in use on {host}: choose another --rdzv-endpoint port, or stop "
     "what holds it (ss -ltnp 'sport = :{port}')"),
    (re.compile(r"RendezvousTimeoutError"),
     "rendezvous timed out: not every node joined {endpoint} in time; check that each node runs the same "
     "--rdzv-id and --rdzv-endpoint, that {endpoint} is reachable from every node, or raise "
     "--rdzv-conf join_timeout=SECONDS"),
    (re.compile(r"RendezvousConnectionError|DistNetworkError|Connection refused|Name or service not known"),
     "cannot reach the rendezvous at {endpoint}: is the first node up, does its name resolve here, and is "
     "the port open between nodes?"),
    (re.compile(r"collective timed out|Timed out waiting|Watchdog caught collective operation timeout"),
     "a collective timed out: a rank hung or died (see the per-rank logs in the run directory); raise "
     "dist.timeout_s if steps are legitimately slower"),
]


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="python -m train.launch", description=__doc__.splitlines()[0])
    p.add_argument("--nnodes", help="N or MIN:MAX (elastic)")
    p.add_argument("--nproc-per-node", help="processes per node: a number, or auto (one per GPU, else 2)")
    p.add_argument("--node-rank", help="this node's rank (ignored by c10d, which assigns ranks)")
    p.add_argument("--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous (omit for one node)")
    p.add_argument("--rdzv-id", help="job id shared by all nodes; keep it across restarts")
    p.add_argument("--rdzv-conf", help="extra rendezvous settings, e.g. join_timeout=600,last_call_timeout=30")
    p.add_argument("--max-restarts", help="times torchrun restarts the workers after a failure")
    p.add_argument("--stop-timeout", help="stop budget, seconds: after a stop signal the workers finish their "
                   "step and save within it, or are killed (default 30; keep it below the scheduler's grace "
                   "period)")
    p.add_argument("--max-failed-launches", help="after this many launches in a row that fail without advancing "
                   "the checkpoint step (a bad node, data that crashes a worker), exit 2 instead of 1 or 75 so "
                   "that the scheduler stops retrying (default 3; 0: never)")
    p.add_argument("--doctor", action="store_true", default=None,
                   help="run the preflight doctor on the same world first (also LAUNCH_DOCTOR=1)")
    p.add_argument("--debug", action="store_true", default=None,
                   help="verbose NCCL and torch.distributed logs into the run directory (also LAUNCH_DEBUG=1)")
    p.add_argument("--dry-run", action="store_true", help="print the torchrun command and exit")
    args, rest = p.parse_known_args(argv)
    if rest and rest[0] == "--":
        rest = rest[1:]
    return args, rest


def resolve(args: argparse.Namespace, env: Mapping[str, str]) -> dict[str, str | None]:
    """Each option from the command line, else its environment variables, else its default."""
    out = {}
    for name, (names, default) in OPTIONS.items():
        value = getattr(args, name)
        if value is None:
            value = next((env[n] for n in names if env.get(n)), default)
        out[name] = value
    if not out["rdzv_endpoint"] and out["nnodes"] != "1":
        for addr, port in (("MASTER_ADDR", "MASTER_PORT"), ("PET_MASTER_ADDR", "PET_MASTER_PORT")):
            if env.get(addr) and env.get(port):
                host = env[addr]
                if ":" in host and not host.startswith("["):  # an IPv6 address
                    host = f"[{host}]"
                out["rdzv_endpoint"] = f"{host}:{env[port]}"
                break
    return out


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def torchrun_command(opts: dict[str, str | None], train_args: list[str], module: str = "train") -> list[str]:
    nproc = opts["nproc_per_node"]
    if nproc == "auto":
        nproc = str(_gpus() or 2)
    if not str(nproc).isdigit() or int(nproc) < 1:
        raise ConfigError(f"--nproc-per-node must be a positive number or auto, got {nproc!r}")
    nnodes = opts["nnodes"]
    bounds = nnodes.split(":")
    if not (1 <= len(bounds) <= 2 and all(b.isdigit() and int(b) > 0 for b in bounds)
            and int(bounds[0]) <= int(bounds[-1])):
        raise ConfigError(f"--nnodes must be N or MIN:MAX with 0 < MIN <= MAX, got {nnodes!r}")
    if not str(opts["max_restarts"]).isdigit():
        raise ConfigError(f"--max-restarts must be a number >= 0, got {opts['max_restarts']!r}")
    if not str(opts.get("max_failed_launches", "0")).isdigit():
        raise ConfigError(f"--max-failed-launches (MAX_FAILED_LAUNCHES) must be a number >= 0 (0: never stop), "
                          f"got {opts['max_failed_launches']!r}")
    if not str(opts["stop_timeout"]).isdigit() or int(opts["stop_timeout"]) < 1:
        raise ConfigError(f"--stop-timeout (STOP_TIMEOUT) must be a whole number of seconds >= 1, "
                          f"got {opts['stop_timeout']!r}")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
           f"--max-restarts={opts['max_restarts']}", f"--shutdown-timeout={opts['stop_timeout']}"]
    endpoint = opts["rdzv_endpoint"]
    if endpoint:
        split_endpoint(endpoint)
        join_timeout(opts["rdzv_conf"])
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={opts['rdzv_id']}"]
        if opts.get("local_addr"):
            cmd.append(f"--local-addr={opts['local_addr']}")
        if opts["rdzv_conf"]:
            cmd.append(f"--rdzv-conf={opts['rdzv_conf']}")
    elif bounds[-1] == "1":
        cmd.append("--standalone")  # one node: a private rendezvous on a free local port
    else:
        raise ConfigError(f"--nnodes={nnodes} needs --rdzv-endpoint HOST:PORT (or RDZV_ENDPOINT, or "
                          "MASTER_ADDR and MASTER_PORT)")
    return cmd + ["-m", module, *train_args]


def check_training_args(train_args: list[str]) -> config.Config:
    """The same parse `python -m train` does, run once here so a bad config fails before torchrun."""
    ns = config.parse_args(train_args)
    return config.load(ns.config, ns.overrides)


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """HOST:PORT -> (host, port); a bracketed IPv6 address ([fd00::1]:29400) loses its brackets, as in
    torchrun."""
    host, _, port = endpoint.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or not port.isdigit() or not 0 < int(port) < 2**16 or "[" in host or "]" in host:
        raise ConfigError(f"--rdzv-endpoint must be HOST:PORT (or [IPv6]:PORT), got {endpoint!r}")
    return host, int(port)


def rdzv_setting(conf: str | None, key: str) -> str | None:
    """One key=value of --rdzv-conf (the last one given), or None."""
    found = None
    for item in (conf or "").split(","):
        k, _, v = item.partition("=")
        if k.strip() == key:
            found = v.strip()
    return found


def join_timeout(conf: str | None) -> float:
    """The rendezvous join timeout (torchrun's default: 600 s), as --rdzv-conf join_timeout sets it."""
    value = rdzv_setting(conf, "join_timeout")
    try:
        return float(value) if value is not None else 600.0
    except ValueError:
        raise ConfigError(f"--rdzv-conf join_timeout must be a number of seconds, got {value!r}") from None


# What probe_endpoint finds: this host serves it (free here, or already a c10d store), it is another
# host's and answers, it is not up yet (no name, nothing listening: wait), or a local port held by
# something else (fail).
HOSTED, STORE, REACHABLE, NOT_YET, HELD = "hosted", "store", "reachable", "not-yet", "held"


def probe_endpoint(endpoint: str, timeout_s: float = 5.0) -> tuple[str, str, str | None]:
    """(kind, what, address) for a rendezvous HOST:PORT: free on this host, served by a c10d store (another
    agent of this job on this host), in use by something else, on another host and reachable, or not up
    yet. The address is this node's, as the rendezvous host sees it (None when unknown)."""
    from datetime import timedelta

    import torch.distributed as dist

    host, port = split_endpoint(endpoint)
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError as e:
        return NOT_YET, f"{host} does not resolve yet ({e.strerror or e})", None
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store binds: TIME_WAIT is free
        try:
            s.bind(addr)
            return HOSTED, f"{endpoint} is free on this host", addr[0]
        except OSError as e:
            if e.errno != errno.EADDRINUSE:  # not an address of this host: check it is reachable
                try:
                    with socket.create_connection(addr[:2], timeout=timeout_s) as c:
                        return REACHABLE, f"{endpoint} is reachable", c.getsockname()[0]
                except OSError as e2:
                    return NOT_YET, f"{endpoint} is not reachable yet ({e2.strerror or e2})", None
    # In use here: fine if it is a c10d store (another agent of this job), not if it is anything else.
    # A store client of something that accepts but never answers can hang past its timeout, so the
    # probe runs in a child process that is killed if it does not answer in time. A fork: the launcher
    # calls this before torchrun and any other thread (safe); the doctor calls it after its process group
    # started gloo's/NCCL's threads, and there a fork can hang in the child (CPython gh-112275, see
    # train/data.py): the kill below bounds it, at worst a wrong "in use by another program" row.
    def probe():
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)  # the store client's C++ complaints are not news
        try:
            dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        except Exception:
            os._exit(1)
        os._exit(0)

    child = multiprocessing.get_context("fork").Process(target=probe, daemon=True)
    child.start()
    child.join(timeout_s + 1)
    if child.exitcode is None:
        child.kill()
        child.join()
    elif child.exitcode == 0:
        return STORE, f"{endpoint} is served by a c10d store on this host", addr[0]
    return HELD, (f"port {port} on {host} is in use by another program: choose another --rdzv-endpoint "
                  f"port, or stop what holds it (ss -ltnp 'sport = :{port}')"), None


def check_world(cfg: config.Config, cmd: list[str]) -> None:
    """The batch arithmetic of the world torchrun will start, when its size is fixed (--nnodes=N, or
    MIN:MAX with MIN == MAX): a usage error found here, once, instead of by every worker."""
    flags = dict(a[2:].split("=", 1) for a in cmd if a.startswith("--") and "=" in a)
    bounds = flags["nnodes"].split(":")
    if bounds[0] == bounds[-1]:
        config.validate(cfg, int(bounds[0]) * int(flags["nproc-per-node"]))


def _marker(run_dir: Path, name: str, launch_id: str) -> dict | None:
    """A marker the workers of this node wrote during this launch (.launch/<launch id>.<name>: USAGE_ERROR from
    train/__main__.py; STARTED, STOPPED and FINISHED from checkpoint.py): found by this launch's id, never
    by clocks, which may differ between hosts, and each node's launcher has its own."""
    try:
        marker = json.loads((run_dir / ".launch" / f"{launch_id}.{name}").read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else {}


def _forget_markers(run_dir: Path, launch_id: str) -> None:
    for path in (run_dir / ".launch").glob(f"{launch_id}.*"):
        with contextlib.suppress(OSError):
            path.unlink()


def port_status(endpoint: str, timeout_s: float = 5.0) -> tuple[bool, str]:
    """(ok, what) for a rendezvous HOST:PORT now (the doctor's row): see probe_endpoint."""
    kind, what, _ = probe_endpoint(endpoint, timeout_s)
    return kind in (HOSTED, STORE, REACHABLE), what


class _Stopped(Exception):
    pass


class _NotUp(RuntimeError):
    """The rendezvous host did not come up within the join timeout: nothing was trained (exit 75)."""


_SAID: list[str] = []  # the launcher's last line of this launch (the restart-loop check quotes it)


def _say(line: str) -> None:
    """The launcher's last line (one of them), on stderr."""
    _SAID[:] = [line]
    print(line, file=sys.stderr, flush=True)


class Signals:
    """The launcher's one handler for stop signals, from the first line of main() to its exit. It records
    each signal; the first one is passed on to the running torchrun (the doctor's or the training's) as
    SIGTERM, once; one that comes while no torchrun runs is seen by main() before it starts the next."""

    def __init__(self) -> None:
        self.received: list[tuple[int, float]] = []  # (signal, time)
        self.child: subprocess.Popen | None = None
        self.forwarded = False
        self.workers: set[int] = set()  # the training processes, known when the stop came
        self.round: int | None = None  # torchrun's round of those workers (None: none ran when the stop came)
        self.last_round = 0  # the highest round of workers seen so far (see() and the stop)

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
                continue  # started under nohup: a hang-up is not a stop, here or in torchrun and the workers
            signal.signal(sig, self._handle)

    @property
    def name(self) -> str:
        return signal.Signals(self.received[0][0]).name if self.received else "a stop signal"

    def _handle(self, signum, frame) -> None:
        self.received.append((signum, time.time()))
        self._forward()

    def _forward(self) -> None:
        if self.received and not self.forwarded and self.child is not None and self.child.poll() is None:
            self.forwarded = True
            self.workers.update(_children(self.child.pid))  # known now, in case torchrun ends before they do
            self.round = _round_of(self.workers)
            self.child.send_signal(signal.SIGTERM)

    def run(self, cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
        """Start torchrun; a stop that came before it started reaches it at once."""
        self.child = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, errors="replace", bufsize=1, env=env)
        self._forward()
        return self.child

    def see(self) -> None:
        """Note the round of torchrun's workers running now (polled while torchrun runs)."""
        if self.child is not None and (r := _round_of(_children(self.child.pid))) is not None:
            self.last_round = max(self.last_round, r)

    def check(self) -> None:
        """Raise _Stopped if a stop came (between the steps of the launcher's own work)."""
        if self.received:
            raise _Stopped(self.name)


def wait_for_rendezvous(opts: dict[str, str | None], signals: Signals, poll_s: float = 1.0) -> dict[str, str | None]:
    """Block until this node can join the rendezvous: it hosts it, or the host's name resolves and its
    port answers. A node started before the rendezvous host waits for it, within the join timeout, as
    torchrun itself would. Returns the options for torchrun: rdzv_conf, and local_addr, the address
    the other nodes reach this one at (from the route to the rendezvous host, not from the hostname).
    Raises RuntimeError (one line) for a local port held by another program or a host still not up at
    the deadline, _Stopped on a stop signal."""
    endpoint, conf = opts["rdzv_endpoint"], opts["rdzv_conf"] or ""
    timeout = join_timeout(conf)
    deadline, said = time.monotonic() + timeout, None
    while True:
        signals.check()
        kind, what, local = probe_endpoint(endpoint)
        if kind == HELD:
            raise RuntimeError(what)
        if kind != NOT_YET:
            break
        if time.monotonic() >= deadline:
            raise _NotUp(f"the rendezvous host is not up after {timeout:g} s: {what}; nothing was trained, so a "
                         f"retry loses nothing (exit {EXIT_REQUEUE}); if it stays down, start the first node, check "
                         "that its name resolves here and the port is open between nodes, or raise --rdzv-conf "
                         "join_timeout=SECONDS")
        if what != said:
            print(f"launch: waiting up to {timeout:g} s for the rendezvous host: {what}", file=sys.stderr, flush=True)
            said = what
        time.sleep(poll_s)
    signals.check()
    if said:
        print(f"launch: {what}", file=sys.stderr, flush=True)
    # torchrun hosts the store only where the endpoint's name is this machine's hostname or resolves to
    # its address; a node name that differs (an /etc/hosts alias, a SLURM NodeName, a service name)
    # would make the node that must host it wait as a client. The bind above has just shown it is ours.
    # (Not on a loopback address: several nodes of one machine may race for it, and torch's own guess,
    # which falls back to a client when the port is taken, handles that.)
    if kind == HOSTED and rdzv_setting(conf, "is_host") is None and not ipaddress.ip_address(
            local.split("%")[0]).is_loopback:
        from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

        try:
            ours = _matches_machine_hostname(split_endpoint(endpoint)[0])
        except OSError:  # this machine's own hostname does not resolve
            ours = False
        if not ours:
            conf = f"{conf},is_host=1" if conf else "is_host=1"
    return opts | {"rdzv_conf": conf, "local_addr": opts.get("local_addr") or local}


def explain(output: str, opts: dict[str, str | None]) -> str:
    """One line: why torchrun failed and what to try."""
    endpoint = opts["rdzv_endpoint"] or "the local rendezvous"
    host, port = split_endpoint(opts["rdzv_endpoint"]) if opts["rdzv_endpoint"] else ("localhost", "?")
    for pattern, hint in HINTS:
        if pattern.search(output):
            return hint.format(endpoint=endpoint, host=host, port=port)
    restarts = opts["max_restarts"]
    block = output.rpartition("Root Cause")[2].split("=" * 20)[0]
    fields = dict(re.findall(r"^\s*(host|rank|exitcode)\s*:\s*(-?\S+)", block, re.M))
    if len(fields) == 3:
        rank, where, code = fields["rank"], fields["host"], fields["exitcode"]
        how = f"was killed by signal {-int(code)}" if int(code) < 0 else f"exited with code {code}"
        return (f"rank {rank} on {where} {how}, and torchrun gave up after {restarts} restart(s) "
                f"(--max-restarts={restarts}); see its log in the run directory")
    return f"torchrun failed (--max-restarts={restarts}); see the output above and the run directory's logs"


def requeue_exit_code(env: Mapping[str, str]) -> int:
    """The code the launcher exits with for "stopped after a checkpoint": REQUEUE_EXIT_CODE, or 75."""
    value = env.get(REQUEUE_CODE_VAR, "").strip()
    if not value:
        return EXIT_REQUEUE
    if not value.isdigit() or not 3 <= int(value) <= 255:
        raise ConfigError(f"{REQUEUE_CODE_VAR} must be an exit code from 3 to 255 (0, 1 and 2 mean done, failed "
                          f"and usage error), got {value!r}")
    return int(value)


def main(argv: list[str] | None = None) -> int:
    rc = _main(argv)
    if rc == EXIT_REQUEUE and (code := requeue_exit_code(os.environ)) != EXIT_REQUEUE:
        print(f"launch: exit {code} in place of {EXIT_REQUEUE} ({REQUEUE_CODE_VAR}={code}): the scheduler retries "
              f"it", file=sys.stderr)
        return code
    return rc


def _main(argv: list[str] | None) -> int:
    signals = Signals()
    signals.install()  # first: a stop during the launcher's own work is never lost, nor kills it half-way
    args, train_args = parse_args(argv)
    try:
        requeue_exit_code(os.environ)  # a bad value is a usage error now, not at the end of a run
        cfg = check_training_args(train_args)
        opts = resolve(args, os.environ)
        cmd = torchrun_command(opts, train_args)
        check_world(cfg, cmd)
        if not args.dry_run:
            from train.log import make_run_dir  # imports torch, which torchrun needs next anyway

            # Here, once: a worker could not even leave its usage-error marker in an unwritable folder,
            # and torchrun would restart it as a crash.
            make_run_dir(cfg.run_dir)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.dry_run:
        print("+ " + shlex.join(cmd), file=sys.stderr, flush=True)
        return 0
    history = History(cfg.run_dir, opts)
    try:
        rc = _launch(args, opts, cmd, cfg, train_args, signals)
    except _NotUp as e:  # nothing was trained: the job should be retried (PyTorchJob: 143, recreated), a few times
        _say(f"launch: {e}")
        return history.end(EXIT_REQUEUE, failed=True)
    return history.end(rc, failed=rc == 1)


def _launch(args: argparse.Namespace, opts: dict[str, str | None], cmd: list[str], cfg: config.Config,
            train_args: list[str], signals: Signals) -> int:
    """Wait for the rendezvous host, run the doctor if asked, then the training's torchrun: the exit code."""
    try:
        if opts["rdzv_endpoint"]:
            try:
                opts = wait_for_rendezvous(opts, signals)
            except _NotUp:
                raise
            except RuntimeError as e:
                _say(f"error: {e}")
                return 1
            cmd = torchrun_command(opts, train_args)
        debug = bool(args.debug or os.environ.get("LAUNCH_DEBUG", "0") not in ("", "0"))
        if args.doctor or os.environ.get("LAUNCH_DOCTOR", "0") not in ("", "0"):
            # Once (a failed check is not retried), with its own rendezvous id: a finished rendezvous is
            # closed and could not host the training.
            doctor = torchrun_command(opts | {"rdzv_id": f"{opts['rdzv_id']}-doctor", "max_restarts": "0"},
                                      train_args, "train.doctor")
            print("+ " + shlex.join(doctor), file=sys.stderr, flush=True)
            signals.check()
            failure = "error: the preflight doctor failed: see its FAIL rows above"
            if (rc := _run(doctor, opts, cfg, signals, failure, debug)) != 0:
                return rc
        signals.check()
        print("+ " + shlex.join(cmd), file=sys.stderr, flush=True)
        return _run(cmd, opts, cfg, signals, debug=debug)
    except _Stopped as e:
        _say(f"launch: stopped on {e} before training started; nothing was trained since the last checkpoint: "
             f"relaunch to continue (exit {EXIT_REQUEUE})")
        return EXIT_REQUEUE


class History:
    """Restart loops: a job whose every launch fails before its checkpoint step advances (a bad node, a data
    file that crashes a worker, a rendezvous host that never comes up) would be requeued or recreated for
    ever. Each node's launcher keeps, in <run_dir>/.launch/history[.<node>].json (written atomically), the
    step its launches started from and how many in a row failed there; the launch that makes it
    --max-failed-launches ends with exit 2 (the scheduler stops retrying) and one line naming the step and
    its last failure. A launch that advances the step or finishes starts the count again; a stop (a
    preemption) neither counts nor resets it; after the exit 2 the count starts again, for the relaunch by
    hand."""

    def __init__(self, run_dir: Path, opts: dict[str, str | None]) -> None:
        self.limit = int(opts.get("max_failed_launches") or 0)
        node = "" if opts["nnodes"] == "1" else "." + re.sub(r"[^\w.-]", "_", opts["node_rank"] or socket.gethostname())
        self.path = run_dir / ".launch" / f"history{node}.json"
        self.checkpoints = run_dir / "checkpoints"
        self.start = self._step()

    def _step(self) -> int:
        from train.checkpoint import NAME, complete_checkpoints  # imports torch, as torchrun does anyway

        found = complete_checkpoints(self.checkpoints)
        return int(NAME.match(found[0].name).group(1)) if found else 0

    def _read(self) -> dict:
        try:
            found = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return found if isinstance(found, dict) else {}

    def _write(self, record: dict | None) -> None:
        with contextlib.suppress(OSError):  # the count is a safeguard: a run directory that refuses it still runs
            if record is None:
                self.path.unlink(missing_ok=True)
                return
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            tmp.write_text(json.dumps(record))
            os.replace(tmp, self.path)

    def end(self, rc: int, failed: bool) -> int:
        """The launcher's exit code, rc or 2 for a restart loop; updates the history."""
        if rc == 0 or self._step() > self.start:
            self._write(None)
            return rc
        if not failed:
            return rc
        before = self._read()
        count = before.get("failed", 0) + 1 if before.get("step") == self.start else 1
        last = _SAID[0] if _SAID else f"exit {rc}"
        if self.limit and count >= self.limit:
            self._write(None)
            _say(f"error: {count} launches in a row failed without advancing the checkpoint past step {self.start} "
                 f"(the last: {last.removeprefix('error: ').removeprefix('launch: ')}): not retried (exit "
                 f"{EXIT_USAGE}); fix the cause and relaunch, or raise --max-failed-launches (MAX_FAILED_LAUNCHES)")
            return EXIT_USAGE
        self._write({"step": self.start, "failed": count, "last": last, "time": time.time()})
        return rc


def worker_env(env: Mapping[str, str], run_dir: Path, debug: bool) -> dict[str, str]:
    """The environment torchrun and the workers get. Variables already set win over these defaults."""
    out = dict(env)
    defaults = {
        # torch 2.14's agent shares its rendezvous store with the workers without a per-round prefix, so
        # a restarted or re-formed group reads the dead group's addresses and fails to connect. A store
        # per round (hosted by the new rank 0) avoids that.
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        # NCCL flight recorder: the last collectives of every rank, dumped when one times out.
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": str(run_dir.resolve() / "flight_recorder" / "rank_"),
    }
    if debug:
        defaults |= {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,COLL,NET",
                     "NCCL_DEBUG_FILE": str(run_dir.resolve() / "logs" / "nccl.%h.%p.log"),
                     "TORCH_DISTRIBUTED_DEBUG": "DETAIL", "TORCH_CPP_LOG_LEVEL": "INFO",
                     "LOGLEVEL": "INFO"}
    for key, value in defaults.items():
        out.setdefault(key, value)
    return out


def _children(pid: int) -> set[int]:
    """The child processes of pid (torchrun's workers), from /proc; empty where it cannot be read."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found |= {int(c) for c in (task / "children").read_text().split()}
        except (OSError, ValueError):
            pass
    return found


def _round_of(pids: set[int]) -> int | None:
    """torchrun's round of these workers (their TORCHELASTIC_RESTART_COUNT, from /proc), None if none is read.
    torch 2.14's agent counts its restarts after a failure there; the workers' markers carry it."""
    rounds = set()
    for pid in pids:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        rounds |= {int(v[27:]) for v in env if v.startswith(b"TORCHELASTIC_RESTART_COUNT=") and v[27:].isdigit()}
    return max(rounds) if rounds else None


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state not in "ZX"
    except (OSError, IndexError):
        return False


def _wait_for(pids: set[int], deadline: float) -> set[int]:
    """Wait until these processes have ended or the deadline passed; returns those still running."""
    while (left := {p for p in pids if _alive(p)}) and time.time() < deadline:
        time.sleep(0.2)
    return left


def _wait(proc: subprocess.Popen, timeout: float) -> int | None:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def _run(cmd: list[str], opts: dict[str, str | None], cfg: config.Config, signals: Signals,
         failure: str | None = None, debug: bool = False) -> int:
    """Run torchrun (the training's, or with `failure` the doctor's), passing stop signals on; map its end
    to 0, 75 (stopped after a checkpoint, or before training began: requeue) or 1 (one line)."""
    launch_id = uuid.uuid4().hex
    budget = int(opts["stop_timeout"])
    env = worker_env(os.environ, cfg.run_dir, debug) | {LAUNCH_ID_VAR: launch_id}
    if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN and "PET_SIGNALS_TO_HANDLE" not in env:
        # nohup: torchrun must not turn a hang-up into a stop either (its --signals-to-handle, TERM, INT, HUP
        # and QUIT by default); left ignored, SIGHUP stays ignored in torchrun and in the workers it starts.
        env["PET_SIGNALS_TO_HANDLE"] = "SIGTERM,SIGINT,SIGQUIT"
    if debug:
        (cfg.run_dir / "logs").mkdir(parents=True, exist_ok=True)
    # stderr is passed through line by line and kept (the tail) to explain a failure afterwards.
    proc = signals.run(cmd, env)
    stop = signals.received
    tail: list[str] = []
    usage: list[str] = []  # a worker's usage error: torchrun is stopped rather than let retry it

    def pump():
        held: list[str] = []  # a traceback, kept back until its last line says what it is
        chained = False  # a dropped traceback's "The above exception ..." lines are dropped with it
        for line in proc.stderr:
            tail.append(line)
            del tail[:-400]
            if not held and line.startswith("Traceback (most recent call last):"):
                held.append(line)
                continue
            if held:
                held.append(line)
                if line.startswith(" ") or not line.strip():  # (a traceback may hold an empty line)
                    continue
                # torchrun's own SignalException is how it acknowledges a stop (sent to the launcher, or to
                # torchrun itself); a rendezvous error is said in the launcher's last line: neither is news.
                quiet = "SignalException" in line or QUIET_TRACEBACK.search(line)
                lines, held, chained = ([] if quiet else held), [], bool(quiet)
            elif chained and (not line.strip() or line.startswith(("The above exception", "During handling"))):
                continue
            else:
                lines, chained = [line], False
            sys.stderr.writelines(lines)
            sys.stderr.flush()
        sys.stderr.writelines(held)

    pumping = threading.Thread(target=pump, daemon=True)
    pumping.start()
    while (rc := _wait(proc, 0.5)) is None:
        signals.see()
        if not usage and not stop and (marker := _marker(cfg.run_dir, "USAGE_ERROR", launch_id)) is not None:
            usage.append(marker.get("error", "a usage error"))
            proc.send_signal(signal.SIGTERM)  # the workers wait for it (train/__main__.py): nothing retries
    if stop:
        # torchrun ends early when a third SIGTERM reaches it (SLURM signals every process of the step,
        # and so does this launcher): the workers are still saving. Leaving now would let the scheduler
        # kill them; wait for them within the stop budget, as torchrun would have.
        left = _wait_for(signals.workers, stop[0][1] + budget + 5)
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    pumping.join(timeout=5)
    try:
        return _verdict(rc, cfg, signals, launch_id, budget, usage, tail, opts, failure)
    finally:
        _forget_markers(cfg.run_dir, launch_id)


def _verdict(rc: int, cfg: config.Config, signals: Signals, launch_id: str, budget: int, usage: list[str],
             tail: list[str], opts: dict[str, str | None], failure: str | None) -> int:
    """The launcher's exit code for how torchrun ended, and its last line. torchrun's restarts (--max-restarts)
    keep the launch's id: a STOPPED or STARTED marker counts only if the round that ended wrote it, the round
    running when the stop came, else the last one torchrun ran (whose workers cleared the markers of the
    rounds before it, train/__main__.py)."""
    stop = signals.received
    if rc == 0:
        return 0
    if usage:
        _say(f"error: {usage[0]} (found by the workers; not retried)")
        return EXIT_USAGE
    if failure is not None and stop:
        raise _Stopped(signals.name)  # the doctor trains nothing
    if stop and _marker(cfg.run_dir, "FINISHED", launch_id) is not None:
        _say("launch: the run finished before the stop took effect (exit 0)")
        return 0
    markers = {name: _marker(cfg.run_dir, name, launch_id) for name in ("STARTED", "STOPPED")}
    ended = signals.round if stop else max([signals.last_round, *(m.get("round", 0) for m in markers.values() if m)])
    started, stopped = (m if m is not None and m.get("round", 0) == ended else None for m in markers.values())
    if stopped is not None:
        name = signals.name if stop else stopped.get("signal") or "a peer rank signal"
        _say(f"launch: stopped on {name}; the workers checkpointed: relaunch to continue (exit {EXIT_REQUEUE})")
        return EXIT_REQUEUE
    if stop and started is None:
        _say(f"launch: stopped on {signals.name} before the workers began training (rendezvous, start-up or "
             f"resume); nothing was trained since the last checkpoint: relaunch to continue (exit {EXIT_REQUEUE})")
        return EXIT_REQUEUE
    if stop:
        _say(f"error: stopped on {signals.name}, but no checkpoint was written within the stop budget "
             f"(--stop-timeout={budget} s), after which the workers are killed: raise STOP_TIMEOUT (one step "
             f"plus one checkpoint save plus a margin), and the scheduler's grace period above it")
        return 1
    if failure is None and (hang := _marker(cfg.run_dir, "HANG", launch_id)) is not None:
        _say(f"error: {hang.get('error', 'a collective timed out')}")  # train/hang.py's line
        return 1
    _say(failure or f"error: {explain(''.join(tail), opts)}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
